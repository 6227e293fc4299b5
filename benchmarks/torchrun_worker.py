"""The torchrun worker of the recovery benchmark: the standard elastic pattern.

Started by ``torchrun`` (one agent per node, ``--nproc-per-node=1``): at start it loads the
job's checkpoint file if there is one, wraps the model in DDP, trains, and rank 0 saves a
checkpoint every ``BENCH_CKPT_EVERY`` steps (default 10) with write-to-temp + rename, so a
restarted group always finds a complete file. A membership change makes torchrun kill and
restart every worker, which resume from that file: the steps since it was written are done
again.

Same model, data and output lines as ``recovery_worker.py`` (see there); ``<group>`` is the
pid of this group's rank-0 worker, agreed with one all-reduce at start.
Knobs: ``BENCH_CKPT`` (the checkpoint path, required), ``BENCH_CKPT_EVERY``,
``BENCH_HIDDEN``, ``BENCH_BATCH``, ``BENCH_MAX_STEPS``, ``BENCH_PG_TIMEOUT`` (seconds, 30).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery_worker import (  # noqa: E402 - after the path tweak
    LR,
    MAX_STEPS,
    build_model,
    forward_backward,
    now,
    say,
    warm_up,
)

CKPT = os.environ.get("BENCH_CKPT", "")
CKPT_EVERY = int(os.environ.get("BENCH_CKPT_EVERY", "10"))
PG_TIMEOUT_S = float(os.environ.get("BENCH_PG_TIMEOUT", "30"))


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Atomically replace the checkpoint file (rank 0 only)."""
    tmp = f"{CKPT}.tmp.{os.getpid()}"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
               tmp)
    os.replace(tmp, CKPT)


def main() -> int:
    if not CKPT:
        raise SystemExit("set BENCH_CKPT to the checkpoint path")
    torch.set_num_threads(1)
    model = build_model()
    warm_up(model)
    # env:// from the torchrun agent; 30 s like peer-elastic's default collective timeout
    # (torch's own default for gloo is 30 minutes).
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    step = 0
    if os.path.exists(CKPT):
        ckpt = torch.load(CKPT, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = int(ckpt["step"])
    ddp = DistributedDataParallel(model)
    tag = torch.tensor([os.getpid() if rank == 0 else 0], dtype=torch.int64)
    dist.all_reduce(tag)
    group = int(tag.item())
    say("GROUP", group, rank, world, os.getpid(), os.getppid(), now(), "resume", step)
    while step < MAX_STEPS:
        optimizer.zero_grad(set_to_none=True)
        forward_backward(ddp, step, rank)
        optimizer.step()
        step += 1
        say("STEP", step, now(), group, rank, world, os.getpid())
        if rank == 0 and step % CKPT_EVERY == 0:
            save_checkpoint(model, optimizer, step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
