"""A coordination-only peer in its own process, for kill/stop tests.

Usage: python -m tests.helpers.member_proc ENDPOINTS JOB  (settings from PEER_ELASTIC_*)
Prints one line per fact, flushed: ``MEMBER <id>``, ``GEN <n> <rank> <size>``,
``REJOINED <id>``, ``DONE``, ``ERROR <message>``. SIGTERM leaves gracefully.
"""

from __future__ import annotations

import signal
import sys
import threading

from peer_elastic.config import JobSettings
from peer_elastic.errors import JobFinished, PeerElasticError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator


def main() -> int:
    endpoints, job = sys.argv[1], sys.argv[2]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = EtcdClient(endpoints, retry_budget_s=30)
    coord = Coordinator(client, job, JobSettings.from_env()).start()
    print(f"MEMBER {coord.member_id}", flush=True)
    last, member = 0, coord.member_id
    try:
        while not stop.is_set():
            try:
                a = coord.wait_generation(after=last, timeout=0.2)
            except TimeoutError:
                continue
            if coord.member_id != member:
                member = coord.member_id
                print(f"REJOINED {member}", flush=True)
            last = a.generation
            print(f"GEN {a.generation} {a.rank} {a.size}", flush=True)
    except JobFinished:
        print("DONE", flush=True)
    except PeerElasticError as exc:
        print(f"ERROR {exc}", flush=True)
        return 1
    finally:
        coord.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
