"""PendingCheck (peer_elastic.torch.check.pending_check) over a real gloo group of 2-4 processes.

The async generation exchange must give every rank the same answer at the same call (so all
raise together, one check after a rank first saw the change), must never wait on an op of
another group, and must surface a peer's death as a collective failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

JOIN_TIMEOUT_S = 120.0
CURRENT = 7  # the generation of the group the ranks train in
CALLS = 6


def _init(store_path: str, rank: int, world: int, timeout_s: float = 60.0) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _agreement_worker(store_path: str, rank: int, world: int, raiser: int, at: int,
                      out: Any) -> None:
    """Rank ``raiser`` reports CURRENT + 1 at call ``at`` (a newer generation, or a lost
    lease), and rank r proposes a check period of r + 2; returns per call whether the
    completed exchange says "reset", and the period it agreed."""
    try:
        import torch
        import torch.distributed as dist

        from peer_elastic.torch.check.pending_check import PendingCheck

        _init(store_path, rank, world)
        group = object()
        pending = PendingCheck()
        answers: list[tuple[bool, int] | None] = []
        for call in range(CALLS):
            result = pending.complete(group)
            answers.append(None if result is None
                           else (result.newest_generation > CURRENT, result.period))
            want = CURRENT + 1 if (rank == raiser and call >= at) else CURRENT
            pending.issue(group, want, torch.device("cpu"), period=rank + 2)
        # Another group's op is dropped unread: complete() returns at once, with nothing.
        assert pending.complete(object()) is None and not pending.pending
        dist.barrier()  # the dropped op was issued on every rank: gloo completes it anyway
        dist.destroy_process_group()
        out.put((rank, answers))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _run(target: Any, store: str, world: int, *args: Any, reports: int | None = None
         ) -> dict[int, Any]:
    """Run ``target(store, rank, world, *args, out)`` in ``world`` processes; collect what
    ``reports`` of them (all by default) put on ``out``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(store, rank, world, *args, out))
             for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world if reports is None else reports):
            rank, value = out.get(timeout=JOIN_TIMEOUT_S)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_every_rank_gets_the_same_answer_at_the_same_call(tmp_path: Path, world: int) -> None:
    raiser, at = world - 1, 2
    results = _run(_agreement_worker, str(tmp_path / "store"), world, raiser, at)
    for rank, answers in results.items():
        assert not isinstance(answers, str), f"rank {rank} failed:\n{answers}"
    # Call 0 has nothing to complete; a change reported at call `at` shows at call at + 1
    # on every rank alike (one check later than a blocking exchange). The period agreed is
    # the smallest proposed (rank 0's), on every rank.
    expected = [None] + [(call > at, 2) for call in range(1, CALLS)]
    assert all(answers == expected for answers in results.values()), results


def _dying_worker(store_path: str, rank: int, world: int, out: Any) -> None:
    """Rank 1 dies with an op pending; the others' complete() must fail as a collective
    failure, not hang and not return an answer."""
    try:
        import torch
        import torch.distributed as dist

        from peer_elastic.torch.check.pending_check import PendingCheck
        from peer_elastic.torch.group import is_collective_failure

        _init(store_path, rank, world, timeout_s=10.0)
        group = object()
        pending = PendingCheck()
        pending.issue(group, CURRENT, torch.device("cpu"))
        assert pending.complete(group) is not None  # one healthy round first
        dist.barrier()
        if rank == 1:
            os._exit(0)  # dies without issuing: the others' op can never complete
        pending.issue(group, CURRENT, torch.device("cpu"))
        try:
            pending.complete(group)
        except Exception as exc:
            out.put((rank, ("failed", is_collective_failure(exc), pending.pending)))
            return
        out.put((rank, ("completed", False, pending.pending)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


@pytest.mark.slow
def test_a_peer_dying_with_an_op_pending_fails_the_next_check(tmp_path: Path) -> None:
    results = _run(_dying_worker, str(tmp_path / "store"), 3, reports=2)
    assert set(results) == {0, 2}, results
    for rank, value in results.items():
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
        # A collective failure (the run loop restores the last commit), and the op is gone.
        assert value == ("failed", True, False), (rank, value)


def _max_exchange_worker(store_path: str, rank: int, world: int, out: Any) -> None:
    """Two rounds through one MaxExchange (the buffer is reused), blocking and started."""
    try:
        import torch
        import torch.distributed as dist

        from peer_elastic.torch.check.max_exchange import MaxExchange

        _init(store_path, rank, world)
        exchange = MaxExchange(3, torch.device("cpu"))
        first = exchange.run((rank, -rank, 7))
        work = exchange.start((10 * rank, 5, -(2**62)))
        work.wait()
        second = exchange.read()
        try:
            exchange.start((1, 2))
            wrong_length = "accepted"
        except ValueError as exc:
            wrong_length = str(exc)
        dist.destroy_process_group()
        out.put((rank, (first, second, wrong_length)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


@pytest.mark.slow
def test_max_exchange_gives_every_rank_the_elementwise_max(tmp_path: Path) -> None:
    """The per-step protocol's one collective (peer_elastic.torch.check.max_exchange): written
    through a host view and issued on the process group's own method, it must still give
    every rank the MAX of every rank's values, round after round in the same buffer."""
    world = 3
    results = _run(_max_exchange_worker, str(tmp_path / "store"), world)
    for rank, value in results.items():
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
        first, second, wrong_length = value
        assert first == [world - 1, 0, 7], (rank, first)
        assert second == [10 * (world - 1), 5, -(2**62)], (rank, second)
        assert wrong_length == "2 values for a buffer of 3", (rank, wrong_length)


def test_max_exchange_without_a_group_says_so() -> None:
    import torch

    from peer_elastic.torch.check.max_exchange import MaxExchange

    with pytest.raises(RuntimeError, match="no default process group"):
        MaxExchange(2, torch.device("cpu")).start((1, 2))
