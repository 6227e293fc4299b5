"""Rejoin: the steps after a lost member lease, driven without etcd (the coordinator's side
of them is in test_coordination.py)."""

from __future__ import annotations

import random

import pytest

from peer_elastic.errors import LeaseLost
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.rejoin import (
    BACKOFF_CAP_S,
    STREAK_ENDS_AFTER_S,
    Listing,
    Rejoin,
    backoff_s,
)


class Steps:
    """The coordinator's two steps, recorded."""

    def __init__(self, rejoin: Rejoin) -> None:
        self.rejoin = rejoin
        self.calls: list[str] = []

    def end(self) -> None:
        self.calls.append("end")

    def register(self) -> str:
        self.calls.append("register")
        self.rejoin.registered()  # what the coordinator's adoption of a registration does
        return "b-2"


def test_a_lost_lease_ends_the_registration_at_once_and_registers_when_the_gate_opens() -> None:
    counters, wakes = CoordinatorCounters(), []
    rejoin = Rejoin(counters, lambda: wakes.append(1))
    left = False
    rejoin.hold(lambda: left)
    assert wakes and not rejoin.pending and not rejoin.due(registered=True)
    rejoin.lease_lost("b-1", "refresh refused")
    assert rejoin.pending and rejoin.due(registered=True)
    steps = Steps(rejoin)
    rejoin.act("b-1", True, steps.end, steps.register)
    assert steps.calls == ["end"] and rejoin.pending and counters.rejoins == 0
    assert not rejoin.due(registered=False)  # held: nothing to do until the gate opens
    left = True
    assert rejoin.due(registered=False)
    rejoin.act("b-1", False, steps.end, steps.register)
    assert steps.calls == ["end", "register"] and not rejoin.pending and counters.rejoins == 1


def test_without_auto_rejoin_the_lost_lease_ends_the_registration_and_raises() -> None:
    rejoin = Rejoin(CoordinatorCounters(), lambda: None, auto=False)
    rejoin.lease_lost("b-1", "expired")
    steps = Steps(rejoin)
    with pytest.raises(LeaseLost):
        rejoin.act("b-1", True, steps.end, steps.register)
    assert steps.calls == ["end"]


def test_a_key_gone_from_the_view_after_it_was_listed_is_a_lost_lease() -> None:
    rejoin = Rejoin(CoordinatorCounters(), lambda: None)
    assert rejoin.observe_listing(False, incarnation=1) is Listing.NOT_YET
    assert not rejoin.pending
    assert rejoin.observe_listing(True, incarnation=1) is Listing.LISTED
    assert rejoin.observe_listing(False, incarnation=1) is Listing.GONE
    assert rejoin.pending
    rejoin.registered()
    # The next registration is not listed yet: that is not a loss.
    assert rejoin.observe_listing(False, incarnation=2) is Listing.NOT_YET
    assert not rejoin.pending


def test_the_backoff_grows_with_losses_in_a_row_and_is_random_below_its_cap() -> None:
    rng = random.Random(7)
    assert backoff_s(1, rng) == 0.0  # a first loss registers again at once
    for losses, cap in ((2, 0.5), (3, 1.0), (4, 2.0), (7, 16.0), (30, BACKOFF_CAP_S)):
        waits = [backoff_s(losses, rng) for _ in range(200)]
        assert all(0.0 <= w <= cap for w in waits), losses
        assert max(waits) > cap / 2 and min(waits) < cap / 2  # spread out, not one value


def test_leases_lost_in_a_row_wait_before_registering_again() -> None:
    """A host that loses lease after lease adds no registrations while it backs off; a
    registration that lasted ends the run of losses."""
    clock = [1000.0]
    rejoin = Rejoin(CoordinatorCounters(), lambda: None, rng=random.Random(3),
                    clock=lambda: clock[0])
    steps = Steps(rejoin)

    def lose(after_s: float) -> float:
        """Lose the current registration ``after_s`` after it began; the wait it gets."""
        clock[0] += after_s
        rejoin.lease_lost("b", "expired")
        rejoin.act("b", True, steps.end, steps.register)
        waited = 0.0
        while rejoin.pending:
            assert not rejoin.due(registered=False)
            clock[0] += 0.01
            waited += 0.01
            rejoin.act("b", False, steps.end, steps.register)
        return waited

    assert lose(after_s=100) < 0.02  # the first: at once
    waits = [lose(after_s=2) for _ in range(6)]  # then in a row, each soon after the last
    assert all(w <= min(BACKOFF_CAP_S, 0.5 * 2 ** k) + 0.02 for k, w in enumerate(waits))
    assert sum(waits) > 1.0
    assert lose(after_s=STREAK_ENDS_AFTER_S + 1) < 0.02  # a registration that lasted
