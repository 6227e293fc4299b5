"""The worker of tests/test_torchrun.py: all-reduces, resumes from a step file, records agents.

``RDZV_TEST_DIR`` (required): ``step`` (the last finished step, rank 0 writes it), ``rank0``
(pids of the group-rank-0 agent and of its worker: torchrun starts workers in a session
of their own, so killing an agent's process group leaves its worker running; then the
MASTER_ADDR the workers were given), ``rounds`` (one
line per worker start: group rank, agent pid, world size) and ``done`` (world size at the end).
``RDZV_TEST_STEPS``: steps in all (default 60). ``RDZV_TEST_FINISH_WORLD``: a group smaller
than this does not finish, it goes on past the last step (waiting for a joiner; default 0).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    out = os.environ["RDZV_TEST_DIR"]
    steps = int(os.environ.get("RDZV_TEST_STEPS", "60"))
    finish_world = int(os.environ.get("RDZV_TEST_FINISH_WORLD", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    group_rank = int(os.environ["GROUP_RANK"])
    with open(os.path.join(out, "rounds"), "a") as f:
        f.write(f"{group_rank} {os.getppid()} {world}\n")
    step_file = os.path.join(out, "step")
    start = torch.tensor([0])
    if rank == 0 and os.path.exists(step_file):
        with open(step_file) as f:
            start[0] = int(f.read() or 0)
    dist.broadcast(start, 0)
    if rank == 0:
        with open(os.path.join(out, "rank0.tmp"), "w") as f:
            f.write(f"{os.getppid()} {os.getpid()} {os.environ['MASTER_ADDR']}")
        os.replace(os.path.join(out, "rank0.tmp"), os.path.join(out, "rank0"))
    t = torch.zeros(1)
    step = int(start[0])
    while step < steps or world < finish_world:  # the same decision on every rank
        t.fill_(1.0)
        dist.all_reduce(t)
        assert int(t[0]) == world
        if rank == 0:
            with open(step_file + ".tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(step_file + ".tmp", step_file)
        step += 1
        time.sleep(0.1)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "done"), "w") as f:
            f.write(str(world))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
