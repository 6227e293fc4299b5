"""Two real gloo ranks, for tests/test_abort.py: rank 0 wraps a model in DDP (which keeps
the group alive), then leaves the group with ``destroy_default_group`` and stays alive;
rank 1 enters a collective rank 0 never joins and reports how long it took to fail.

Usage: ``python -m tests.helpers.ddp_group_exit RANK STORE_FILE [--no-cut]``. ``--no-cut``
leaves the group with a plain ``destroy_process_group`` (what the fix replaced).
"""

from __future__ import annotations

import gc
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.torch.gloo.abort import GroupConnections
from peer_elastic.torch.group import destroy_default_group


def main() -> None:
    rank, path = int(sys.argv[1]), sys.argv[2]
    cut = "--no-cut" not in sys.argv
    gc.disable()  # as between two automatic collections: the DDP cycle is not freed
    store = dist.FileStore(path, 2)
    with GroupConnections.capture() as connections:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    ddp(torch.ones(2, 4)).sum().backward()
    if rank == 0:
        if cut:
            print(f"LEFT_OPEN {destroy_default_group(connections)}", flush=True)
        else:
            dist.destroy_process_group()
            print("LEFT_OPEN -", flush=True)
        time.sleep(120)  # alive: only the group is gone, not the process
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("COMPLETED", flush=True)
    except RuntimeError as exc:
        print(f"FAILED {time.monotonic() - t0:.3f} {str(exc)[:120]!r}", flush=True)


if __name__ == "__main__":
    main()
