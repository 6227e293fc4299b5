"""peer_elastic.torch.transport.direct_all_reduce over a real gloo group of 3 processes: the hot path's
all-reduce must give what ``dist.all_reduce`` gives, on the default group and a subgroup,
and hand the wrapper's own cases (complex tensors, no group) back to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.world import run_world

WORLD = 3


def _reduce_all(rank: int, world: int, outdir: Path) -> None:
    import torch
    import torch.distributed as dist

    from peer_elastic.torch.transport.direct_all_reduce import all_reduce_now, start_all_reduce

    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it
    got: dict[str, list] = {}
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
        got["pair"] = start_all_reduce(in_pair, group=pair).get_future().wait()[0].tolist()
    dist.barrier()
    (outdir / f"{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_direct_all_reduce_gives_what_dist_all_reduce_gives(tmp_path: Path) -> None:
    run_world(_reduce_all, WORLD, tmp_path)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["sum"] == [0.0, 6.0, 12.0, 18.0], got  # (1 + 2 + 3) * arange
        assert got["max"] == [WORLD - 1, 0], got
        assert got["complex"] == [3.0, 6.0], got  # 1+0j + 1+2j + 1+4j
        if rank < 2:
            assert got["pair"] == [3.0, 3.0], got
        else:
            assert "pair" not in got


def test_without_a_group_the_error_is_torchs_own() -> None:
    import torch

    from peer_elastic.torch.transport.direct_all_reduce import all_reduce_now

    with pytest.raises((RuntimeError, ValueError), match="process group"):
        all_reduce_now(torch.zeros(1))
