"""The peer-elastic worker of the recovery benchmark, and the model both workers share.

Both this worker and ``torchrun_worker.py`` train the same MLP on the same synthetic data
(generated from the global step number and the rank, nothing downloaded) with SGD and
momentum, and print one flushed line per completed optimizer step::

    STEP <global step> <unix time> <group> <rank> <world> <pid>

``<group>`` identifies the process group the step was taken in (here the peer-elastic
generation; torchrun's worker uses rank 0's pid), so the harness can tell which steps the
re-formed group took. Other lines: ``READY <unix time> <pid>`` once the model is built and
warmed up, right before the worker enters the elastic system (``pe.join()``), and
``GROUP <group> <rank> <world> <pid> <ppid> <unix time>`` whenever a group is (re)formed.

This worker: ``pe.join()`` + ``TorchState(model, DistributedOptimizer(SGD), step)`` with a
commit after every step, and every peer-elastic setting from ``PEER_ELASTIC_*`` variables
(the benchmark leaves the timing settings at their defaults). Knobs: ``BENCH_HIDDEN``,
``BENCH_BATCH``, ``BENCH_MAX_STEPS``, ``BENCH_LOG_LEVEL`` (peer-elastic's log, as
``LOG <unix time> ...`` lines, for looking into a slow reset).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn

IN_DIM = 256
CLASSES = 10
HIDDEN = int(os.environ.get("BENCH_HIDDEN", "512"))
BATCH = int(os.environ.get("BENCH_BATCH", "128"))
MAX_STEPS = int(os.environ.get("BENCH_MAX_STEPS", "1000000"))
LR = 0.01


def say(*parts: object) -> None:
    """One line to stdout in a single write (atomic on a pipe), flushed at once."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def now() -> str:
    """Wall-clock time as printed in every line (same clock in every process)."""
    return f"{time.time():.6f}"


def build_model(hidden: int = HIDDEN) -> nn.Module:
    """The benchmark MLP; the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_DIM, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


_TEACHER: torch.Tensor | None = None


def batch_for(step: int, rank: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic, deterministic batch of ``rank`` at global ``step``: Gaussian inputs,
    labels from a fixed random linear teacher."""
    global _TEACHER
    if _TEACHER is None:
        _TEACHER = torch.randn(IN_DIM, CLASSES, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(step * 4099 + rank)
    x = torch.randn(batch, IN_DIM, generator=g)
    return x, (x @ _TEACHER).argmax(dim=1)


def forward_backward(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    """Loss and gradients of one batch (the optimizer step is the caller's)."""
    x, y = batch_for(step, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def warm_up(model: nn.Module) -> None:
    """One local forward/backward so first-call overheads do not land in a measured step."""
    forward_backward(model, 0, 0)
    model.zero_grad(set_to_none=True)


def main() -> int:
    torch.set_num_threads(1)
    if os.environ.get("BENCH_LOG_LEVEL"):
        import logging

        level = os.environ["BENCH_LOG_LEVEL"].upper()
        os.environ["PEER_ELASTIC_LOG_LEVEL"] = level  # pe.join() sets its logger's level
        logging.basicConfig(level=level, stream=sys.stdout, force=True,
                            format="LOG %(created).6f %(threadName)s %(name)s: %(message)s")
    import torch.distributed as dist

    import peer_elastic as pe

    model = build_model()
    warm_up(model)
    optimizer = pe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    join = pe.join  # imports the rest of the library (lazily loaded) before READY, as the
    # torchrun and torchft workers import theirs: READY means "imported, about to join"
    say("READY", now(), os.getpid())
    with join() as peer:
        state = pe.TorchState(model=model, optimizer=optimizer, step=0)

        def train(state: pe.TorchState) -> int:
            rank, world = dist.get_rank(), dist.get_world_size()
            gen = peer.generation
            say("GROUP", gen, rank, world, os.getpid(), os.getppid(), now())
            while state.step < MAX_STEPS:
                state.optimizer.zero_grad(set_to_none=True)
                forward_backward(state.model, state.step, rank)
                state.optimizer.step()
                state.step += 1
                say("STEP", state.step, now(), gen, rank, world, os.getpid())
                state.commit()  # save in memory + check for membership changes
            return state.step

        peer.run(train, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
