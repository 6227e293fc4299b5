"""Two real gloo ranks, for tests/test_abort.py: rank 1 posts a receive and prints READY
(the test then SIGSTOPs it, so its kernel stops taking data once its receive buffer is
full); rank 0 sends it far more than fits, so gloo queues the rest of the send on the
socket, and cuts the group's connections ``--flush`` seconds after giving them room
(0: a plain cut). Prints ``SENT <seconds> <outcome>``: how long the send took to end.

Usage: ``python -m tests.helpers.queued_send RANK STORE_FILE GO_FILE [--flush S]``; rank 0
starts sending once GO_FILE exists.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from peer_elastic.torch.gloo.abort import GroupConnections

TIMEOUT_S = 30.0
ELEMENTS = 16 * 1024 * 1024  # 64 MB of float32: more than the receiver's buffers take


def main() -> None:
    rank, store_path, go = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    flush_s = float(sys.argv[sys.argv.index("--flush") + 1]) if "--flush" in sys.argv else 0.0
    store = dist.FileStore(store_path, 2)
    with GroupConnections.capture() as connections:
        group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))
    data = torch.zeros(ELEMENTS)
    if rank == 1:
        group.recv([data], 0, 0)
        print("READY", flush=True)
        time.sleep(600)
        return
    while not go.exists():
        time.sleep(0.01)
    work = group.send([data], 1, 0)
    time.sleep(1.0)  # the receiver's buffers fill; the rest waits in gloo's queue
    print(f"QUEUED {not work.is_completed()}", flush=True)
    threading.Thread(target=connections.cut, kwargs={"flush_s": flush_s}, daemon=True).start()
    t0 = time.monotonic()
    try:
        work.wait()
        outcome = "completed"
    except RuntimeError as exc:
        outcome = "failed: " + str(exc).splitlines()[0][:120]
    print(f"SENT {time.monotonic() - t0:.2f} {outcome}", flush=True)


if __name__ == "__main__":
    main()
