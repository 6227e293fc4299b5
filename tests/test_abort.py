"""Abandoning a collective stuck on a peer whose lease is gone.

Unit tests of the pieces on real sockets and a fake group (no torch), then the real
thing: gloo peers over a real etcd, one of them SIGSTOPped while the others wait for it in
a collective whose timeout is longer than the test's bound.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from peer_elastic.torch.gloo.abort import GroupConnections, HangWatchdog, Loss, endpoint_matcher
from peer_elastic.torch.gloo.held_connections import HeldConnections
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.procs import Cluster, PeerProc, assert_exactly_once, others_output
from tests.helpers.worker_lines import start_world_of_3


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv
    srv.close()


def test_capture_keeps_new_connections_but_not_listeners_older_ones_or_etcd(listener) -> None:
    etcd = socket.socket()
    etcd.bind(("127.0.0.1", 0))
    etcd.listen()
    old = socket.create_connection(listener.getsockname())
    old_server, _ = listener.accept()
    to_etcd_matcher = endpoint_matcher([("localhost", etcd.getsockname()[1])])
    with GroupConnections.capture(exclude=to_etcd_matcher) as found:
        extra_listener = socket.socket()
        extra_listener.bind(("127.0.0.1", 0))
        extra_listener.listen()
        mine = socket.create_connection(listener.getsockname())
        to_etcd = socket.create_connection(etcd.getsockname())
    try:
        assert found.inodes == {os.fstat(mine.fileno()).st_ino}
    finally:
        for s in (etcd, old, old_server, extra_listener, mine, to_etcd):
            s.close()


def test_cut_wakes_a_blocked_receive_on_both_ends_and_leaves_the_fd_open(listener) -> None:
    with GroupConnections.capture() as found:
        mine = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    got: dict[str, object] = {}

    def receive(name: str, s: socket.socket) -> None:
        try:
            got[name] = s.recv(10)
        except OSError as exc:
            got[name] = exc

    threads = [threading.Thread(target=receive, args=(n, s), daemon=True)
               for n, s in (("mine", mine), ("theirs", theirs))]
    for t in threads:
        t.start()
    assert found.cut() == 1
    for t in threads:
        t.join(10)
    assert got == {"mine": b"", "theirs": b""}  # both see the connection end at once
    assert mine.fileno() >= 0  # shut down, not closed: the owner closes it
    assert found.cut() == 1  # idempotent: shutting down again is harmless
    mine.close()
    theirs.close()
    assert found.cut() == 0  # a closed fd (maybe reused by now) is left alone


def test_shut_for_reading_ends_this_end_only_and_holds_the_connection_open(listener) -> None:
    # What an abandon does: this end's blocked receive ends at once; the other end hears
    # nothing, and its writes still go through after this end's owner (gloo) closed its
    # descriptor, so a frozen peer woken later finds no reset; once released, it ends.
    with GroupConnections.capture() as found:
        mine = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    got: list[object] = []
    receiver = threading.Thread(target=lambda: got.append(mine.recv(10)), daemon=True)
    receiver.start()
    held_sockets = found.shut_for_reading()
    receiver.join(10)
    assert got == [b""] and len(held_sockets) == 1
    held = HeldConnections()
    held.hold(held_sockets)
    mine.close()  # gloo closes its descriptor on the error; the duplicate keeps it open
    theirs.settimeout(0.5)
    with pytest.raises(TimeoutError):
        theirs.recv(10)  # no FIN
    for _ in range(3):
        theirs.sendall(b"x" * 1000)  # no reset
        time.sleep(0.05)
    assert found.without(held.inodes()).inodes == frozenset()  # a teardown leaves it be
    held.release()
    theirs.settimeout(10)
    try:
        ended = theirs.recv(10)  # FIN, or a reset for the bytes it never read
    except ConnectionResetError:
        ended = b""
    assert ended == b""
    assert found.shut_for_reading() == []  # nothing open is left to shut
    theirs.close()


def test_held_connections_keep_the_newest_abandons_and_close_older_ones() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    held = HeldConnections(keep=2)
    for a, _ in pairs:
        held.hold([a])
    assert len(held) == 2 and pairs[0][0].fileno() == -1  # the oldest abandon's closed
    assert held.inodes() == {os.fstat(a.fileno()).st_ino for a, _ in pairs[1:]}
    held.release()
    assert len(held) == 0 and all(a.fileno() == -1 for a, _ in pairs)
    with pytest.raises(ValueError):
        HeldConnections(keep=0)
    for _, b in pairs:
        b.close()


class FakeGroups:
    """A group slot and a lost-peer verdict the test controls (a WatchedGroups); wakes like
    the job view (a Changes)."""

    def __init__(self) -> None:
        self.grace = 1.0
        self.cond = threading.Condition()
        self.version = 0
        self.current: object | None = None
        self.why: str | None = None
        self.aborted: list[tuple[object, str]] = []

    def set(self, **changes: object) -> None:
        with self.cond:
            for k, v in changes.items():
                setattr(self, k, v)
            self.version += 1
            self.cond.notify_all()

    def wait_change(self, version: int, timeout: float, until=None) -> int:  # noqa: ANN001
        with self.cond:
            self.cond.wait_for(
                lambda: self.version != version or (until is not None and until()), timeout)
            return self.version

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def current_group(self) -> object | None:
        return self.current

    def lost_peer(self, group: object) -> Loss | None:
        return None if self.why is None else Loss(self.why, self.grace)

    def abandon(self, group: object, why: str) -> bool:
        with self.cond:
            self.aborted.append((group, why))
            self.cond.notify_all()
        return True

    def watchdog(self, grace: float) -> HangWatchdog[object]:
        self.grace = grace
        return HangWatchdog(self, self)


def test_watchdog_cuts_a_group_still_current_after_the_grace() -> None:
    fake = FakeGroups()
    dog = fake.watchdog(grace=0.2).start()
    try:
        group = object()
        fake.set(current=group)
        fake.set(why="m1 lost its lease")
        with fake.cond:
            assert fake.cond.wait_for(lambda: fake.aborted, 10)
        assert fake.aborted == [(group, "m1 lost its lease")]
        # Still the same group: it is not cut twice.
        fake.set(why="m1 lost its lease (again)")
        with fake.cond:
            assert not fake.cond.wait_for(lambda: len(fake.aborted) > 1, 0.5)
        # A new group that also lost a peer is judged afresh.
        second = object()
        fake.set(current=second)
        with fake.cond:
            assert fake.cond.wait_for(lambda: len(fake.aborted) == 2, 10)
        assert fake.aborted[1][0] is second
    finally:
        dog.stop()


def test_watchdog_spares_a_group_the_training_thread_leaves_within_the_grace() -> None:
    fake = FakeGroups()
    dog = fake.watchdog(grace=3.0).start()
    try:
        fake.set(current=object())
        fake.set(why="m1 lost its lease")
        fake.set(current=None, why=None)  # the next check_host_updates left the group
        with fake.cond:
            assert not fake.cond.wait_for(lambda: fake.aborted, 4.0)
    finally:
        dog.stop()
    assert dog.aborted == 0


# -- the real thing ------------------------------------------------------------------------


@pytest.mark.slow
def test_leaving_a_group_a_ddp_wrapper_keeps_alive_fails_the_peer_waiting_on_it(
        tmp_path) -> None:
    # Real gloo, two processes. Rank 0 built DDP on the group (its reducer holds the group,
    # in a reference cycle the collector has not freed), then leaves the group and lives on;
    # rank 1 waits on it in a collective whose timeout is 60 s. The connections the group
    # opened are shut down on leaving, so rank 1 fails at once, as when no DDP holds it.
    store = tmp_path / "store"
    ranks = [PeerProc([sys.executable, "-m", "tests.helpers.ddp_group_exit", str(r), str(store)],
                      dict(os.environ), f"rank{r}") for r in (0, 1)]
    try:
        left = ranks[0].wait_line("LEFT_OPEN", timeout=120)
        assert int(left.split()[1]) >= 1, left  # without the cut they would stay open
        failed = ranks[1].wait_line("FAILED", timeout=120)
        took = float(failed.split()[1])
        assert took < 20, failed  # far below the 60 s collective timeout
        assert "closed" in failed.lower() or "reset" in failed.lower(), failed
    finally:
        for p in ranks:
            p.kill()


SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    # Beyond the bound the test gives the others to re-form (REFORM_BOUND_S): only
    # abandoning the collective can meet it. Not far beyond, and the project's default: the
    # stopped peer, woken, may itself wait this long where gloo had queued one of its sends
    # (woken_peer_rejoins below). With DDP over a subgroup it did in 5 of 11 stops before
    # the others held their connections open (peer_elastic.torch.gloo.held_connections), and
    # at 60 s each such run took 55 s longer.
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 30,
    "PEER_ELASTIC_MIN_NP": 1,
    "WORKER_SAMPLES": 960,
    "WORKER_STEP_S": 0.03,
    "WORKER_EPOCHS": 2,
}


cluster = cluster_fixture(SETTINGS)


#: How long the others may take to re-form without a stopped peer: below the collective
#: timeout (SETTINGS), five times the 4.5 s (lease 3 s, grace 1.5 s) it takes here.
REFORM_BOUND_S = 25
#: What gloo says when a send it had queued on a connection cut meanwhile times out.
QUEUED_SEND_TIMED_OUT = "for send operation to complete"


def stop_one_until_the_others_reform(cluster: Cluster, rank: int) -> str:
    """Start three peers, SIGSTOP the one of ``rank`` in the first generation (rank 0 is the
    oldest, the leader) while the others train, and require them to
    re-form without it (abandoning the collective they were blocked in) long before the
    collective timeout; then SIGCONT it (it finds its lease gone and its connections cut,
    and rejoins as a new member) and check the job's end. Returns the first GEN line the
    others printed after the stop."""
    peers = cluster.start(3)
    victim = peers.index(start_world_of_3(*peers)[rank])  # start order does not decide age
    watcher = next(p for i, p in enumerate(peers) if i != victim)
    watcher.wait_line("STEP", after=len(watcher.lines), timeout=60)
    seen = len(watcher.lines)
    peers[victim].signal(signal.SIGSTOP)
    stopped = time.monotonic()
    line = watcher.wait_line("GEN", after=seen, timeout=REFORM_BOUND_S)
    print(f"re-formed {time.monotonic() - stopped:.2f} s after SIGSTOP: {line}")
    assert "abandoning generation" in "".join(
        p.output() for i, p in enumerate(peers) if i != victim)
    watcher.wait_line("STEP", after=len(watcher.lines), timeout=60)  # training goes on
    seen = len(watcher.lines)
    peers[victim].signal(signal.SIGCONT)
    woken_peer_rejoins(peers, victim, watcher, seen)
    return line


def woken_peer_rejoins(peers: list[PeerProc], victim: int, watcher: PeerProc,
                       seen: int) -> None:
    """The woken peer is listed again before the job ends (the watcher's next GEN line after
    index ``seen``), and the job ends exactly once.

    One exception, gloo's: a peer whose write fails on a reset connection has that send
    queued, and gloo's error path never wakes a queued send (peer_elastic.torch.
    held_connections). Such a peer waits out the collective timeout, the job (seconds of
    training left) ends meanwhile, and the peer, back, finds the job done and exits 0 (the
    run's record outlives the job by the run TTL, 60 s, twice the collective timeout). The
    test then requires exactly that: gloo's own words in its output and a clean end. It
    happened in 7 of 27 stops while the others reset the stopped peer's connections when
    they abandoned them; they hold them open now."""
    try:
        watcher.wait_line("GEN", after=seen, timeout=120)
    except AssertionError as exc:
        if watcher.proc.poll() is None:  # the job goes on and the woken peer is not back
            raise AssertionError(f"{exc}\n{others_output(peers, watcher)}") from None
        result = assert_exactly_once(peers)
        woken = peers[victim].output()
        assert QUEUED_SEND_TIMED_OUT in woken, (
            f"the job ended before the woken peer was back, without gloo's queued send to "
            f"explain it:\n{woken}")
        print(f"woken peer back only after gloo's queued send timed out: {result}")
        return
    assert_exactly_once(peers)


@pytest.mark.slow
def test_survivors_abandon_a_collective_stuck_on_a_stopped_leader(cluster: Cluster) -> None:
    # The oldest peer is rank 0 and the leader. Stopped, it leaves the others blocked in the
    # next gradient all-reduce: its lease (3 s) ends, the next-oldest leads, and the grace
    # (1.5 s) passes before they abandon the collective.
    line = stop_one_until_the_others_reform(cluster, rank=0)
    assert line.split()[3] == "2", line


@pytest.mark.slow
def test_a_ddp_subgroup_made_in_a_reset_callback_is_abandoned_with_its_group(
        etcd: str, unique_job: str) -> None:
    # DDP reduces over a subgroup that the reset callback makes (dist.new_group), as over a
    # device mesh's groups. A stopped peer leaves the others blocked in DDP's all-reduce on
    # that subgroup: its connections are cut with the group's, so they re-form long before
    # the collective timeout (without the cut they were still blocked after 90 s).
    cluster = Cluster(etcd, unique_job, **SETTINGS, WORKER_DDP=1, WORKER_DDP_SUBGROUP=1)
    try:
        stop_one_until_the_others_reform(cluster, rank=2)
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_subgroup_made_in_the_training_function_is_abandoned_with_its_group(
        etcd: str, unique_job: str) -> None:
    # The same, but the training function makes the subgroup and the DDP wrapper each time
    # it is entered, long after the group formed and outside any reset callback: the
    # connections of every group made in the generation are known by the gloo listeners
    # its store carried (gloo_records.GlooListeners), and are cut with the group.
    cluster = Cluster(etcd, unique_job, **SETTINGS, WORKER_DDP=1, WORKER_DDP_SUBGROUP="train")
    try:
        stop_one_until_the_others_reform(cluster, rank=1)
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_peer_woken_past_its_lease_is_not_listed_while_its_training_thread_is_elsewhere(
        etcd: str, unique_job: str) -> None:
    # The woken peer's training thread stays in the old group for a while: here in a slow
    # batch (16 s) it was stopped in; in the wild in a send gloo had queued on a connection
    # cut meanwhile, which waits out the collective timeout. Re-registered at once, as
    # before, the peer was listed again and the others waited for it in their next
    # rendezvous until its batch ended (9 s here). Now it registers only once its training
    # thread has left the old group, and the others train on meanwhile.
    cluster = Cluster(etcd, unique_job, **{**SETTINGS, "WORKER_EPOCHS": 8},
                      WORKER_SLOW_AT="0:30:16:2")
    try:
        peers = cluster.start(3)
        for p in peers:
            p.wait_line("GEN", timeout=90)
        slow = None
        deadline = time.monotonic() + 90
        while slow is None:
            assert time.monotonic() < deadline, "no peer reached the slow batch"
            slow = next((p for p in peers if any(x.startswith("SLOW") for x in p.lines)), None)
            time.sleep(0.05)
        others = [p for p in peers if p is not slow]
        seen = [len(p.lines) for p in others]
        slow.signal(signal.SIGSTOP)  # past its lease (3 s), the others re-form without it
        for p, n in zip(others, seen, strict=True):
            p.wait_line("GEN", after=n, timeout=60)
        slow.signal(signal.SIGCONT)  # about 10 s of its batch left
        woke, seen = time.monotonic(), len(slow.lines)
        slow.wait_line("GEN", after=seen, timeout=90)  # back, once its batch ended
        back = time.monotonic() - woke
        for p in others:
            with p.cond:  # the reader appends to both under it
                steps = [t for line, t in zip(p.lines, p.arrived, strict=True)
                         if line.startswith("STEP") and woke < t < woke + back]
            times = [woke, *steps, woke + back]
            gap = max(b - a for a, b in zip(times, times[1:], strict=False))
            print(f"woken peer back {back:.1f} s after SIGCONT; {p.name}'s longest pause "
                  f"in its steps meanwhile {gap:.1f} s")
            assert gap < 5.0, f"{p.name} waited {gap:.1f} s for the woken peer"
        assert back > 5.0, "the slow batch was meant to outlast the wake by seconds"
        assert_exactly_once(peers)
    finally:
        cluster.close()


def _may_force_send_buffers() -> bool:
    with socket.socket() as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), 1 << 26)
            return True
        except OSError:
            return False


@pytest.mark.skipif(not _may_force_send_buffers(),
                    reason="needs CAP_NET_ADMIN (SO_SNDBUFFORCE) for a 64 MB send buffer")
@pytest.mark.slow
def test_a_send_gloo_queued_on_a_stalled_link_ends_when_its_connections_are_cut(
        tmp_path) -> None:
    # Real gloo, two processes. Rank 1 posts a receive and is SIGSTOPped; rank 0 sends it
    # 64 MB, more than rank 1's kernel buffers take, so gloo queues the rest of the send on
    # the socket. gloo's error path never wakes such a send (Pair::signalException skips
    # queued unbound-buffer sends): cut plainly, it waited out the group timeout (30 s,
    # measured). Cut with room for the queued bytes first, it ends at once.
    store, go = tmp_path / "store", tmp_path / "go"
    args = [sys.executable, "-m", "tests.helpers.queued_send"]
    receiver = PeerProc([*args, "1", str(store), str(go)], dict(os.environ), "rank1")
    sender = PeerProc([*args, "0", str(store), str(go), "--flush", "0.2"], dict(os.environ),
                      "rank0")
    try:
        receiver.wait_line("READY", timeout=60)
        receiver.signal(signal.SIGSTOP)
        go.touch()
        assert sender.wait_line("QUEUED", timeout=60) == "QUEUED True", sender.output()
        line = sender.wait_line("SENT", timeout=60)
        took = float(line.split()[1])
        assert took < 10, sender.output()  # the group timeout is 30 s
    finally:
        receiver.kill()
        sender.kill()
