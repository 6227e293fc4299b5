"""LeaseKeeper: batched refreshes, the run lease's own lane, loss confirmed before believed.

Unit tests against a fake client (the real keep-alive stream is exercised by every
coordination test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from peer_elastic.errors import LeaseNotFound
from peer_elastic.etcd.lease import Lane, LeaseKeeper

WAIT_S = 20.0  # generous: the machine may be loaded


class FakeLeases:
    """keepalive / keepalive_many / lease_ttls of an etcd that knows ``alive`` leases.

    ``stall`` (when set) blocks every multi-lease round until released: a member lane
    stuck behind an overloaded etcd or process."""

    def __init__(self, alive: set[int]) -> None:
        self.alive = alive
        self.lock = threading.Condition()
        self.single: dict[int, int] = {}
        self.rounds: list[list[int]] = []
        self.confirmations: list[list[int]] = []  # lease_ttls calls
        self.stall: threading.Event | None = None
        #: Most answers a round gets before its stream is cut short (None: all of them).
        self.answers_per_round: int | None = None
        #: Leases a round answers with TTL 0 although they are alive.
        self.answer_zero: set[int] = set()

    def keepalive(self, lease_id: int, budget_s: float | None = None) -> int:
        with self.lock:
            self.single[lease_id] = self.single.get(lease_id, 0) + 1
            self.lock.notify_all()
            if lease_id not in self.alive:
                raise LeaseNotFound(f"lease {lease_id:x} expired or was revoked")
            return 10

    def keepalive_many(self, lease_ids: Sequence[int],
                       budget_s: float | None = None) -> dict[int, int]:
        stall = self.stall
        if stall is not None:
            stall.wait(WAIT_S)
        with self.lock:
            self.rounds.append(list(lease_ids))
            self.lock.notify_all()
            answered = list(lease_ids)[:self.answers_per_round]
            return {i: (10 if i in self.alive - self.answer_zero else 0) for i in answered}

    def lease_ttls(self, lease_ids: Sequence[int],
                   budget_s: float | None = None) -> dict[int, int]:
        with self.lock:
            self.confirmations.append(list(lease_ids))
            self.lock.notify_all()
            return {i: (10 if i in self.alive else -1) for i in lease_ids}

    def wait(self, predicate, timeout: float = WAIT_S) -> bool:  # noqa: ANN001
        with self.lock:
            return self.lock.wait_for(predicate, timeout)


def test_leases_due_together_are_refreshed_in_one_round() -> None:
    fake = FakeLeases(set(range(1, 201)))
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    try:
        for lease_id in range(1, 201):
            keeper.keep(lease_id, 0.9, lambda *_: None)
        assert fake.wait(lambda: len({i for r in fake.rounds for i in r}) == 200)
        # 200 leases kept within a moment of each other: a handful of rounds, not 200 calls.
        assert len(fake.rounds) <= 10
        assert not fake.single
    finally:
        keeper.stop()


def test_a_lease_a_round_answered_as_gone_is_confirmed_before_it_is_lost() -> None:
    fake = FakeLeases({1, 2, 3})
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    lost: list[int] = []
    gone = threading.Event()

    def on_lost(lease_id: int, why: str) -> None:
        lost.append(lease_id)
        gone.set()

    try:
        for lease_id in (1, 2, 3, 4):
            keeper.keep(lease_id, 0.6, on_lost)
        assert gone.wait(WAIT_S)
        assert lost == [4]
        assert fake.confirmations[0] == [4]  # asked again, not taken from the round
        assert fake.wait(lambda: sum(r.count(1) for r in fake.rounds) >= 2)  # others go on
        assert keeper.scheduled(4) == 0 and keeper.scheduled(1) == 1
    finally:
        keeper.stop()


def test_leases_lost_together_are_confirmed_together_and_rejoined_ones_kept_alive() -> None:
    """An overload that expired every member's lease: the lane confirms them all in one
    call (one by one, two round trips each, the leases the members rejoined with waited
    behind hundreds of them, past their own TTL), and keeps the new leases alive."""
    fake = FakeLeases(set())
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    lost: list[int] = []

    def rejoin(lease_id: int, _why: str) -> None:  # as a member does: a new lease
        with fake.lock:
            lost.append(lease_id)
            fake.alive.add(1000 + lease_id)
        keeper.keep(1000 + lease_id, 0.6, rejoin)

    try:
        for lease_id in range(1, 201):
            keeper.keep(lease_id, 0.6, rejoin)
        assert fake.wait(lambda: len(lost) == 200)
        confirmed = [i for c in fake.confirmations for i in c]
        assert sorted(confirmed) == list(range(1, 201))
        assert len(fake.confirmations) <= 10 and not fake.single
        # every rejoined lease is refreshed, again and again, and none is lost
        assert fake.wait(lambda: all(sum(r.count(1000 + i) for r in fake.rounds) >= 2
                                     for i in range(1, 201)))
        assert len(lost) == 200
    finally:
        keeper.stop()


def test_a_lease_etcd_still_knows_is_kept_and_refreshed_soon() -> None:
    """A round's TTL 0 that TimeToLive contradicts is not a loss."""
    fake = FakeLeases({1, 2})
    fake.answer_zero = {2}
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    lost: list[int] = []
    try:
        for lease_id in (1, 2):  # due together: one round
            keeper.keep(lease_id, 30, lambda lid, _why: lost.append(lid), refresh_now=True)
        assert fake.wait(lambda: bool(fake.confirmations))
        assert fake.confirmations[0] == [2]
        # refreshed again soon (not after a TTL/3, 10 s), and not lost
        assert fake.wait(lambda: fake.single.get(2, 0) + sum(r.count(2) for r in fake.rounds)
                         >= 2, timeout=5.0)
        assert not lost and keeper.scheduled(2) == 1
    finally:
        keeper.stop()


def test_leases_a_cut_short_round_did_not_answer_are_tried_again_soon_not_lost() -> None:
    """A starved process whose keep-alive streams miss their deadline still refreshes the
    leases etcd answered; the others go out again within a moment, in smaller rounds, and
    none is taken for lost (nor confirmed one by one)."""
    fake = FakeLeases(set(range(1, 101)))
    fake.answers_per_round = 30
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    lost: list[int] = []
    try:
        for lease_id in range(1, 101):
            keeper.keep(lease_id, 3.0, lambda lease_id, _why: lost.append(lease_id))
        # 100 leases due together, 30 answered per round: every lease is refreshed within
        # a few rounds, long before its next regular refresh (TTL/3 = 1 s).
        t0 = time.monotonic()
        assert fake.wait(lambda: len({i for r in fake.rounds for i in r[:30]}) == 100)
        first_full = time.monotonic() - t0
        assert len(fake.rounds) >= 4
        assert first_full < WAIT_S
        assert not lost and not fake.single
        for lease_id in (1, 100):
            assert keeper.scheduled(lease_id) == 1
    finally:
        keeper.stop()


def test_a_lease_is_first_refreshed_ttl_3_after_its_grant_was_asked_for() -> None:
    """The TTL runs from the grant on etcd; a starved process may read the answer late."""
    fake = FakeLeases({5, 6})
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    try:
        asked = time.monotonic() - 9.9  # the grant's answer took 9.9 s to be read
        keeper.keep(5, 30.0, lambda *_: None, granted_since=asked)  # due in 0.1 s
        keeper.keep(6, 30.0, lambda *_: None)  # due in 10 s

        def refreshed(lease_id: int) -> bool:
            return bool(fake.single.get(lease_id)) or any(lease_id in r for r in fake.rounds)

        assert fake.wait(lambda: refreshed(5))
        assert not refreshed(6)
    finally:
        keeper.stop()


def test_the_run_lane_is_refreshed_while_member_refreshes_are_stuck() -> None:
    """Hundreds of member leases whose refresh hangs (an overloaded etcd or process) must
    not delay the run lease: its expiry would end the run for every member."""
    fake = FakeLeases(set(range(1, 502)))
    fake.stall = threading.Event()
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]
    run_lease = 501
    try:
        for lease_id in range(1, 501):
            keeper.keep(lease_id, 0.6, lambda *_: None)
        keeper.keep(run_lease, 0.6, lambda *_: None, lane=Lane.RUN)
        t0 = time.monotonic()
        # The run lease (interval 0.2 s) is refreshed again and again meanwhile.
        assert fake.wait(lambda: fake.single.get(run_lease, 0) >= 3)
        assert not fake.rounds  # the member lane is still stuck
        assert time.monotonic() - t0 < WAIT_S
    finally:
        fake.stall.set()
        keeper.stop()


def test_forget_removes_a_lease_from_its_lane() -> None:
    fake = FakeLeases({7})
    keeper = LeaseKeeper(fake)  # type: ignore[arg-type]

    def cb(*_: object) -> None:
        return None

    try:
        keeper.keep(7, 30, cb, lane=Lane.RUN)
        assert keeper.scheduled(7) == 1
        keeper.forget(7, cb)
        assert keeper.scheduled(7) == 0
        keeper.keep(8, 30, cb)
        keeper.forget(8)
        assert keeper.scheduled(8) == 0
    finally:
        keeper.stop()


def test_a_lease_adopted_near_its_end_is_refreshed_at_once(etcd: str) -> None:
    """A run lease adopted from peers that died a while ago (a whole job restarted, slow to
    start) may have less than TTL/3 left: its first refresh cannot wait TTL/3 (real etcd)."""
    from peer_elastic.etcd.client import EtcdClient

    client = EtcdClient(etcd)
    keeper = LeaseKeeper(client, name="adopted")
    lost: list[int] = []
    try:
        lease = client.grant(6)  # refreshed every 2 s once kept
        deadline = time.monotonic() + 30
        while client.lease_ttl(lease) > 1:  # granted by a peer that then died
            assert time.monotonic() < deadline, "the lease never ran down"
            time.sleep(0.1)
        keeper.keep(lease, 6, lambda lid, why: lost.append(lid), lane=Lane.RUN,
                    refresh_now=True)
        time.sleep(3.0)  # past its end, had the first refresh waited 2 s
        assert client.lease_ttl(lease) > 0 and not lost
    finally:
        keeper.stop()
        client.close()
