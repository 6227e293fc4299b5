"""A peer training with pe.DistributedOptimizer and a check after every step, counting the
all-reduces it runs (tests/test_reset_vote.py): the check must add none.

With ``WORKER_DDP=1`` DDP averages the gradients instead, rebuilt in a reset callback with
``pe.allreduce_hook`` (one bucket: the model is small), and the optimizer is a plain one.

Prints ``COUNTED <all-reduces> <steps>`` on every rank at the end. WORKER_STEPS: steps.
With ``WORKER_PLAIN=1`` it makes only the checks, back to back (no step carries the vote: each
check's own exchange does, every P-th check, peer_elastic.torch.check.check_cadence), and prints
``CHECKS <check_exchanges> <checks_spaced>`` too.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import peer_elastic as pe
from tests.helpers import at_exit

STEPS = int(os.environ.get("WORKER_STEPS", "30"))
PLAIN = os.environ.get("WORKER_PLAIN") == "1"
DDP = os.environ.get("WORKER_DDP") == "1"


def main() -> int:
    at_exit.install()  # stacks on SIGUSR1; the threads join() left, at exit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if not DDP:
        optimizer = pe.DistributedOptimizer(optimizer)
    wrapped = {"model": model}

    def rebuild_ddp() -> None:
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, pe.allreduce_hook)
        wrapped["model"] = ddp
    # Counted where every all-reduce of Python passes: the process group's own method
    # (dist.all_reduce calls it, and so does the check's exchange, directly).
    descriptor = dist.ProcessGroup.__dict__["allreduce"]
    real_all_reduce = dist.ProcessGroup.allreduce
    calls = [0]

    def counting_all_reduce(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        return real_all_reduce(self, *args, **kwargs)

    with pe.join() as peer:
        state = pe.TorchState(model=model, optimizer=optimizer, step=0)
        if DDP:
            state.register_reset_callbacks([rebuild_ddp])

        def train(state: pe.TorchState) -> tuple[int, int]:
            # The straggler watch's exchange of paces (an all-reduce about once a second, at
            # the same checks on every rank) is no part of the check's vote: off here.
            peer.straggler.enabled = False
            dist.ProcessGroup.allreduce = counting_all_reduce
            try:
                for _ in range(STEPS):
                    if PLAIN:
                        state.check_host_updates()
                        continue
                    optimizer.zero_grad()
                    wrapped["model"](torch.randn(2, 4)).sum().backward()
                    optimizer.step()
                    state.check_host_updates()
            finally:
                dist.ProcessGroup.allreduce = descriptor  # the method as it was, unbound
            return calls[0], STEPS

        reduces, steps = peer.run(train, state)
    print("COUNTED", reduces, steps, flush=True)
    if PLAIN:
        print("CHECKS", peer.stats.check_exchanges, peer.stats.checks_spaced, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
