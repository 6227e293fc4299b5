"""peer_elastic.torch.direct_all_reduce over a real gloo group of 3 processes: the hot path's
all-reduce must give what ``dist.all_reduce`` gives, on the default group and a subgroup,
and hand the wrapper's own cases (complex tensors, no group) back to it."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

WORLD = 3
TIMEOUT_S = 120.0


def _worker(store_path: str, rank: int, out: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        from peer_elastic.torch.direct_all_reduce import all_reduce_now, start_all_reduce

        dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it
        got: dict[str, list[Any]] = {}
        summed = torch.arange(4, dtype=torch.float32) * (rank + 1)
        all_reduce_now(summed)
        got["sum"] = summed.tolist()
        highest = torch.tensor([rank, -rank], dtype=torch.int64)
        start_all_reduce(highest, dist.ReduceOp.MAX).wait()
        got["max"] = highest.tolist()
        complex_ = torch.tensor([1 + 2j * rank], dtype=torch.complex64)
        all_reduce_now(complex_)  # dist.all_reduce's own case: as real pairs
        got["complex"] = [complex_.real.item(), complex_.imag.item()]
        if rank < 2:
            in_pair = torch.full((2,), float(rank + 1))
            fut = start_all_reduce(in_pair, group=pair).get_future()
            got["pair"] = fut.wait()[0].tolist()
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, got))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_direct_all_reduce_gives_what_dist_all_reduce_gives(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "store"), rank, out))
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=TIMEOUT_S) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    for rank, got in results.items():
        assert not isinstance(got, str), f"rank {rank} failed:\n{got}"
        assert got["sum"] == [0.0, 6.0, 12.0, 18.0], got  # (1 + 2 + 3) * arange
        assert got["max"] == [WORLD - 1, 0], got
        assert got["complex"] == [3.0, 6.0], got  # 1+0j + 1+2j + 1+4j
        if rank < 2:
            assert got["pair"] == [3.0, 3.0], got
        else:
            assert "pair" not in got


def test_without_a_group_the_error_is_torchs_own() -> None:
    import torch

    from peer_elastic.torch.direct_all_reduce import all_reduce_now

    with pytest.raises((RuntimeError, ValueError), match="process group"):
        all_reduce_now(torch.zeros(1))
