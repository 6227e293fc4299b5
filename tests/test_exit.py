"""A peer's process exits cleanly after join(): no thread of peer-elastic, and no thread of
its etcd client, still runs into the interpreter's exit (peer_elastic.process.threads says why:
CPython <= 3.13 ends such threads with pthread_exit, which through gRPC's or torch's C++
aborts the process or leaves a lock held; CI saw peers finish and then never exit)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from peer_elastic.errors import EtcdError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.process import threads
from peer_elastic.process.netaddr import probe
from peer_elastic.process.probe_listener import ProbeListener
from tests.helpers.at_exit import PREFIX
from tests.helpers.procs import Cluster, PeerProc, assert_no_thread_of_ours_left

# Other tests of this process may have left threads winding down: these tests look only at
# their own.


def test_started_threads_are_tracked_until_they_end() -> None:
    release = threading.Event()
    t = threads.start(release.wait, "test-tracked", args=(30.0,))
    assert t.daemon and t.name == "test-tracked"
    assert t in threads.running()
    assert "test-tracked" in threads.wait_all_ended(0.05)  # bounded, and it names it
    release.set()
    t.join(10.0)
    assert t not in threads.running() and "test-tracked" not in threads.wait_all_ended(0.0)


def test_a_thread_does_not_wait_for_itself() -> None:
    seen: list[list[str]] = []
    t = threads.start(lambda: seen.append(threads.wait_all_ended(0.0)), "test-self")
    t.join(10.0)
    assert len(seen) == 1 and "test-self" not in seen[0]


def test_closing_the_probe_listener_ends_its_thread() -> None:
    before = set(threads.running())
    listener = ProbeListener("127.0.0.1")
    (serving,) = set(threads.running()) - before
    assert serving.name == "peer-elastic-probe"
    assert probe("127.0.0.1", listener.port, timeout=1) is None
    listener.close()
    assert not serving.is_alive()


def test_a_closed_client_leaves_no_watch_thread(etcd: str, unique_job: str) -> None:
    # Real etcd. etcd3 runs each client's watch stream on a thread of its own, which ends
    # only after the stream does: close() cancels the stream and waits for it.
    client = EtcdClient(etcd)
    try:
        client.watch_prefix(f"/{unique_job}/", lambda events, rev: None, lambda err: None,
                            start_revision=client.revision())
        # Found by the name etcd3 gives it: a release of etcd3 that names it otherwise
        # fails here rather than leaving the thread unwaited.
        (watch_thread,) = client.watch_threads
        assert watch_thread.is_alive()
        client.put(f"/{unique_job}/k", b"v")
        client.keepalive_many([client.grant(10)])  # a stream read to its end
    finally:
        client.close()
    assert not watch_thread.is_alive() and client.watch_threads == []


@pytest.mark.slow
def test_real_peers_leave_no_thread_running_at_exit(etcd: str, unique_job: str) -> None:
    # Real etcd, two real peers (gloo), a short run, twice: each peer's exit finds no thread
    # of peer-elastic and no etcd watch thread running, and each exits at once.
    for attempt in range(2):
        cluster = Cluster(etcd, f"{unique_job}-{attempt}", PEER_ELASTIC_MIN_NP=2,
                          PEER_ELASTIC_MAX_NP=2, WORKER_STEPS=20)
        try:
            peers = cluster.start(2, module="tests.helpers.vote_worker")
            for p in peers:
                p.wait_line("COUNTED", timeout=120)
                assert p.wait(timeout=60) == 0
                assert_no_thread_of_ours_left(p)
        finally:
            cluster.close()


def test_the_exit_check_fails_on_a_thread_of_ours_or_a_watch_thread() -> None:
    # The check every oracle test makes (procs.assert_no_thread_of_ours_left), on lines as
    # tests/helpers/at_exit.py prints them.
    def worker_printing(line: str) -> PeerProc:
        p = PeerProc([sys.executable, "-c", f"print({line!r})"], dict(os.environ), "fake")
        assert p.wait(timeout=60) == 0
        p.wait_line(PREFIX, timeout=10)
        return p

    assert_no_thread_of_ours_left(worker_printing(f"{PREFIX} ours=[] others=['Thread-3 (_run)']"))
    for line in (f"{PREFIX} ours=['peer-elastic-probe'] others=[]",
                 f"{PREFIX} ours=[] others=['etcd3_watch_7f00']"):
        with pytest.raises(AssertionError, match="outlived join"):
            assert_no_thread_of_ours_left(worker_printing(line))


def test_a_keepalive_whose_stream_end_is_lost_after_every_answer_succeeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The keep-alive stream is read to its end (no cancel: see EtcdClient.keepalive_many);
    # when every answer came and only the end is lost (the stream's deadline passes), the
    # answers stand. An end lost before every answer keeps the answers that came (those
    # leases were refreshed) and leaves the others out; with no answer at all it fails.
    import etcd3
    import grpc
    from etcd3 import etcdrpc

    class LostEnd(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    answered: list[int | None] = [None]  # how many answers come before the end is lost

    class Stub:
        def LeaseKeepAlive(self, reqs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202, N802
            for req in list(reqs)[:answered[-1]]:
                yield etcdrpc.LeaseKeepAliveResponse(ID=req.ID, TTL=9)
            raise LostEnd()

    monkeypatch.setattr(etcd3.MultiEndpointEtcd3Client, "leasestub", property(lambda _: Stub()))
    client = EtcdClient("127.0.0.1:9", retry_budget_s=0.5)
    try:
        assert client.keepalive_many([1, 2]) == {1: 9, 2: 9}
        answered.append(1)  # now only the first answer comes before the end is lost
        assert client.keepalive_many([1, 2]) == {1: 9}
        answered.append(0)  # and now none
        with pytest.raises(EtcdError):
            client.keepalive_many([1, 2])
    finally:
        client.close()
