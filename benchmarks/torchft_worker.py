"""The torchft worker of the recovery benchmark: the same model, data and optimizer as
``recovery_worker.py``, on torchft 0.2.0 (per-step quorum; survivors keep running).

One process is one torchft *replica group* of one rank: it runs its own ``TCPStore`` (the
group's store) and a ``torchft.Manager`` that meets the other replicas through the
Lighthouse whose address is in ``TORCHFT_LIGHTHOUSE`` (the benchmark starts it). Every step::

    manager.start_quorum()                       # async: the quorum forms during forward
    forward / backward                           # batch_for(step, participating rank)
    manager.allreduce(flat gradients).wait()     # averaged over the participants
    if manager.should_commit(): optimizer.step() # every participant agrees, or nobody steps

Gradients are averaged with ``manager.allreduce`` on one flat buffer: torchft's
``DistributedDataParallel`` wrapper kills the survivors on a peer failure in 0.2.0 (an
AssertionError in its ``_comm_hook`` once the manager has errored). A replica that joins, or
one whose step fell behind, is healed by torchft itself: it fetches the ``state_dict`` below
from a up-to-date replica over HTTP (torchft's checkpoint transport) before it steps.

Lines printed (flushed, one write each), as ``recovery_worker.py`` does::

    READY <unix time> <pid>                                  before the Manager is created
    GROUP <group> <rank> <world> <pid> <ppid> <unix time>  at each new group
    STEP <step> <unix time> <group> <rank> <world> <pid>    after each committed step

where ``<group>`` is the quorum id and the number of participants (:func:`group_of`).

Settings (the benchmark sets them): ``TORCHFT_LIGHTHOUSE`` (http://host:port),
``BENCH_REPLICA`` (this replica's id), ``BENCH_TFT_TIMEOUT_S`` (the manager's timeout for
collectives and RPCs, 60 s by default as in torchft), ``BENCH_TFT_QUORUM_TIMEOUT_S`` (60 s).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery_worker import LR, MAX_STEPS, build_model, forward_backward, now, say, warm_up  # noqa: E402


def group_of(manager: object, world: int) -> int:
    """The group a step was taken in: the manager's quorum id and the number of
    participants (``quorum id * 1000 + world``). A replica that heals joins the current
    quorum without a new id and participates from its next step, so the id alone would hide
    the change from 2 to 3 participants. torchft 0.2.0 has no public accessor for the id;
    the attribute is the one its own logs print ("reconfiguring for quorum_id=...")."""
    return int(getattr(manager, "_quorum_id", -1)) * 1000 + world


def main() -> int:
    torch.set_num_threads(1)
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    timeout = timedelta(seconds=float(os.environ.get("BENCH_TFT_TIMEOUT_S", "60")))
    quorum_timeout = timedelta(seconds=float(os.environ.get("BENCH_TFT_QUORUM_TIMEOUT_S", "60")))
    model = build_model()
    warm_up(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    params = [p for p in model.parameters()]

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd: dict[str, object]) -> None:
        model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(sd["optim"])  # type: ignore[arg-type]

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    say("READY", now(), os.getpid())
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{os.environ.get('BENCH_REPLICA', os.getpid())}",
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout,
    )
    seen_quorum = None
    while manager.current_step() < MAX_STEPS:
        manager.start_quorum()
        optimizer.zero_grad(set_to_none=False)
        step = manager.current_step()
        rank = manager.participating_rank() or 0
        forward_backward(model, step, rank)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        if manager.should_commit():
            optimizer.step()
            world = manager.num_participants()
            q = group_of(manager, world)
            if q != seen_quorum:
                seen_quorum = q
                say("GROUP", q, rank, world, os.getpid(), os.getppid(), now())
            say("STEP", manager.current_step(), now(), q, rank, world, os.getpid())
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
