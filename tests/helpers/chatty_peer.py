"""A peer that talks a lot: registers in the job (no torch), waits for a roster of
PEER_ELASTIC_MIN_NP, then writes many long lines fast from several threads to stdout and
stderr, each naming its rank, one with undecodable bytes, and a last one with no newline.

Every line is ``<stream> r<rank> t<thread> n<seq> <payload> END`` so a test can check that
each arrived whole, once, with the launcher's prefix.

No peer leaves before every peer of the roster has chatted: a peer that leaves ends the
generation, and a peer slow to look at it (a loaded machine) would then never see the full
roster it was listed in.
"""

from __future__ import annotations

import os
import sys
import threading

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import client_from_env
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.watch import PrefixWatch

THREADS, LINES, WIDTH = 3, 150, 300
TIMEOUT_S = 60


def everyone_chatted(client, prefix: str, roster: set[str]) -> bool:  # noqa: ANN001
    """Wait until every member of ``roster`` has put its key under ``prefix``."""
    seen: set[str] = set()
    changed = threading.Condition()

    def on_snapshot(kvs, _rev) -> None:  # noqa: ANN001
        with changed:
            seen.clear()
            seen.update(kv.key for kv in kvs)
            changed.notify_all()

    def on_events(events, _rev) -> None:  # noqa: ANN001
        with changed:
            seen.update(e.kv.key for e in events if e.kind == "put")
            changed.notify_all()

    watch = PrefixWatch(client, prefix, on_snapshot, on_events)
    watch.start()
    try:
        with changed:
            return changed.wait_for(lambda: {prefix + m for m in roster} <= seen, TIMEOUT_S)
    finally:
        watch.stop()


settings = JobSettings.from_env()
with client_from_env() as client:
    coord = Coordinator(client, os.environ["PEER_ELASTIC_JOB"], settings).start()
    snap = coord.view.wait_for(lambda s: s.generation is not None
                               and len(s.generation.roster) == settings.min_np
                               and coord.member_id in s.generation.roster, TIMEOUT_S)
    assert snap is not None and snap.generation is not None, "no full roster"
    rank = list(snap.generation.roster).index(coord.member_id)

    def chatter(t: int) -> None:
        for n in range(LINES):
            for name, stream in (("out", sys.stdout.buffer), ("err", sys.stderr.buffer)):
                # One write per line (a thread-safe buffered write, flushed whenever the
                # buffer fills, at any byte): the launcher must reassemble whole lines.
                stream.write(f"{name} r{rank} t{t} n{n} ".encode() + b"x" * WIDTH + b" END\n")

    threads = [threading.Thread(target=chatter, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sys.stderr.buffer.write(f"err r{rank} binary \xff\xfe END\n".encode("latin-1"))
    sys.stdout.buffer.write(f"out r{rank} last END".encode())  # no newline at the end
    sys.stdout.flush()
    sys.stderr.flush()
    chatted = f"/peer-elastic-tests/chatty/{os.environ['PEER_ELASTIC_JOB']}/"
    client.put(chatted + coord.member_id, b"")
    assert everyone_chatted(client, chatted, set(snap.generation.roster)), "a peer never chatted"
    coord.close()
