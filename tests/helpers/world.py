"""Run a function on every rank of a real multi-process gloo group (bounded, no leftovers)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "peer_elastic.state.states"])


def _entry(fn, rank: int, world: int, port: int, outdir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        fn(rank, world, Path(outdir))
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, outdir: Path, timeout: float = 90.0) -> None:
    """Run ``fn(rank, world, outdir)`` in ``world`` fresh processes on one gloo group.

    ``fn`` must be a module-level function (it is pickled by reference). Workers still
    running at ``timeout`` are killed and the call fails; so does any non-zero exit.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    procs = [
        _CTX.Process(target=_entry, args=(fn, r, world, store.port, str(outdir)), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, f"{len(hung)} worker(s) still running after {timeout}s"
    assert [p.exitcode for p in procs] == [0] * world
