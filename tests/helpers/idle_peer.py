"""A member that only keeps its membership (no torch): prints ``READY <member id>`` once it
is registered, then waits until SIGTERM (leaves) or SIGKILL (its lease expires)."""

from __future__ import annotations

import os
import signal
import threading

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import client_from_env
from peer_elastic.etcd.coordinator import Coordinator

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
with client_from_env() as client:
    coord = Coordinator(client, os.environ["PEER_ELASTIC_JOB"], JobSettings.from_env()).start()
    print("READY", coord.member_id, flush=True)
    stop.wait()
    coord.close()
