"""peer-elastic run: every line of every peer whole, once, prefixed with peer and known rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = 4
LINE = re.compile(r"^\[peer(\d)(?: rank(\d)| standby)?\]: (out|err) r(\d) "
                  r"(t\d n\d+ x{300}|binary \\xff\\xfe|last) END$")

def _not_chatter(data: bytes) -> str:
    """What the launcher and the peers said apart from the chatty lines, for a failure."""
    return "\n".join(x for x in data.decode(errors="replace").splitlines() if "END" not in x)


@pytest.mark.slow
def test_run_prefixes_whole_lines_of_chatty_peers(etcd: str, unique_job: str,
                                                  tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    r = subprocess.run(
        [sys.executable, "-m", "peer_elastic.cli", "run", "--etcd", etcd, "--job", unique_job,
         "-n", str(PEERS), "--min-np", str(PEERS), "--start-settle", "0.2", "--settle", "0.05",
         "--log-dir", str(logs), "--tee", "--", sys.executable, "tests/helpers/chatty_peer.py"],
        cwd=ROOT, capture_output=True, timeout=180, env=dict(os.environ))
    assert r.returncode == 0, _not_chatter(r.stderr)[-6000:]
    seen: dict[str, Counter] = {"out": Counter(), "err": Counter()}
    for stream, data in (("out", r.stdout), ("err", r.stderr)):
        for raw in data.decode().splitlines():
            if raw.startswith("peer-elastic:"):
                continue  # the launcher's own notes
            m = LINE.match(raw)
            if m is None:
                # A peer's log line is allowed; a piece of a chatty line is not.
                assert raw.startswith("[peer") and "END" not in raw and "xxx" not in raw, raw
                continue
            peer, shown, name, rank, body = int(m[1]), m[2], m[3], int(m[4]), m[5]
            assert name == stream, f"{name} line on the launcher's {stream}: {raw[:80]}"
            if shown is not None:  # a rank shown is the peer's real one
                assert int(shown) == rank, raw[:80]
            seen[stream][(peer, rank, body.split(" x")[0])] += 1
    per_stream = 3 * 150 + 1  # threads x lines + the binary / last line
    for stream in ("out", "err"):
        assert all(c == 1 for c in seen[stream].values()), "a line came twice"
        assert len(seen[stream]) == PEERS * per_stream, f"{stream}: lines lost"
    # Which lines carry a rank depends on how soon the launcher's watch of the job saw each
    # peer in the roster: on a busy machine a peer can say everything before that (the
    # ranks it shows are checked above). How the launcher learns ranks is
    # test_rank_tracker_labels_a_peer_by_what_etcd_says_of_it.
    # --log-dir: one file per peer, with all of its lines (--tee also kept the terminal).
    for i in range(PEERS):
        lines = (logs / f"peer-{i}.log").read_bytes().decode().splitlines()
        mine = [LINE.match(x) for x in lines]
        mine = [m for m in mine if m is not None]
        assert len(mine) == 2 * per_stream and {int(m[1]) for m in mine} == {i}


def test_rank_tracker_labels_a_peer_by_what_etcd_says_of_it(etcd: str,
                                                            unique_job: str) -> None:
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.ops.ranks import PeerRole, RankTracker

    # Peer 0 of this launcher is this process (host "here"); the other member runs on
    # another host. max_np=1: the younger waits as a standby until the elder leaves.
    settings = JobSettings(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, min_np=1,
                           max_np=1)
    clients = [EtcdClient(etcd) for _ in range(3)]
    tracker = RankTracker(clients[0], unique_job, "here").start()
    elder = Coordinator(clients[1], unique_job, settings, host="elsewhere")
    peer = Coordinator(clients[2], unique_job, settings, host="here")
    try:
        tracker.add(0, os.getpid())
        assert tracker.label(0) == "[peer0]: "  # not registered: the index alone
        elder.start()
        assert elder.view.wait_for(lambda s: s.generation is not None, 30) is not None
        peer.start()
        assert tracker.wait_for_role(0, PeerRole(peer.member_id, None), 30)
        assert tracker.label(0) == "[peer0 standby]: "
        elder.close()
        assert tracker.wait_for_role(0, PeerRole(peer.member_id, 0), 30)
        assert tracker.label(0) == "[peer0 rank0]: "
        assert tracker.label(1) == "[peer1]: "  # a peer it was not told of
    finally:
        peer.close()
        elder.close()
        tracker.stop()
        for c in clients:
            c.close()


def test_multiplexer_cuts_runaway_lines_into_prefixed_pieces(tmp_path: Path) -> None:
    import io
    import threading

    from peer_elastic.ops.multiplex import MAX_LINE, Multiplexer, OutputOptions

    class Sink(io.BytesIO):
        def close(self) -> None:  # keep the bytes readable after the pipe end closes
            pass

    term, err = Sink(), Sink()
    mux = Multiplexer(lambda i: f"[p{i}] ", OutputOptions(tmp_path, tee=True), term, err)
    read_end, write_end = os.pipe()
    writer = threading.Thread(target=lambda: (
        os.write(write_end, b"a" * (MAX_LINE + 5) + b"\nshort\r\ntail"), os.close(write_end)))
    writer.start()
    mux.attach(7, open(read_end, "rb"), None)
    writer.join(30)
    mux.close(30)
    lines = term.getvalue().split(b"\n")
    assert lines == [b"[p7] " + b"a" * MAX_LINE, b"[p7] aaaaa", b"[p7] short", b"[p7] tail", b""]
    assert (tmp_path / "peer-7.log").read_bytes() == term.getvalue()
