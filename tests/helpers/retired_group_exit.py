"""Two real gloo ranks, for tests/test_retired_groups.py: rank 0 retires a group whose
collective is still in flight, lets go of it (its destructor then waits on a helper thread
for the collective), and returns from ``main`` at once; rank 1 completes the collective
only once rank 0 has begun to exit, so the destructor ends while rank 0's interpreter is
exiting. Before the exit waited for such helpers, rank 0 then died of SIGABRT
("terminate called without an active exception") after its work was done.

Usage: ``python -m tests.helpers.retired_group_exit RANK STORE_FILE EXITING_FILE``.
"""

from __future__ import annotations

import atexit
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from peer_elastic.torch.gloo.retired_groups import RetiredGroups


def main() -> None:
    rank, store_path, exiting = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    store = dist.FileStore(store_path, 2)
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    if rank == 1:
        deadline = time.monotonic() + 60
        while not exiting.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        group.allreduce([torch.ones(1)]).wait()
        print("RANK1 DONE", flush=True)
        return
    work = group.allreduce([torch.ones(1)])  # in flight until rank 1 joins it
    retired = RetiredGroups()
    retired.retire(group, work)
    del group, work
    retired.retire(torch.ones(1))  # the group's last reference goes, on a helper thread
    print(f"RELEASED {retired.release(wait_s=0.0)}", flush=True)
    # Registered after peer_elastic's own hook, so it runs first (atexit is LIFO): rank 1
    # completes the collective while rank 0 is on its way out.
    atexit.register(exiting.touch)


if __name__ == "__main__":
    main()
