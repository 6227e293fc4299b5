"""Rejoin: the steps after a lost member lease, driven without etcd (the coordinator's side
of them is in test_coordination.py)."""

from __future__ import annotations

import pytest

from peer_elastic.errors import LeaseLost
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.rejoin import Listing, Rejoin


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
