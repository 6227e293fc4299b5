"""CheckCadence (peer_elastic.torch.check.check_cadence) on a fake clock: which plain checks
exchange, and what period a rank proposes; and two real peers checking back to back. Over
a real group also: tests/test_pending_check.py (the period every rank agrees on) and
tests/test_elastic.py (fast checks, join, leave and crash, exactly once)."""

from __future__ import annotations

import pytest

from peer_elastic.torch.check.check_cadence import BUDGET, MAX_DELAY_S, CheckCadence


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_checks(cadence: CheckCadence, clock: Clock, interval_s: float, cost_s: float,
               calls: int, agreed: int | None = None) -> list[bool]:
    """``calls`` checks ``interval_s`` apart; an exchange costs ``cost_s`` and the group
    agrees on ``agreed`` (this rank's own proposal when None). Which checks exchanged."""
    out = []
    for _ in range(calls):
        clock.now += interval_s
        due = cadence.due()
        out.append(due)
        if due:
            cadence.exchanged(cost_s, agreed if agreed is not None else cadence.proposal())
    return out


def test_a_new_cadence_exchanges_at_every_check_until_it_has_measured() -> None:
    cadence = CheckCadence(clock=Clock())
    assert cadence.proposal() == 1
    assert cadence.due() and cadence.due()


@pytest.mark.parametrize(("interval_s", "cost_s", "period"), [
    (0.100, 200e-6, 1),  # slow steps: an exchange at every check, as without a cadence
    (MAX_DELAY_S, 200e-6, 1),  # at the delay bound still every check
    (0.008, 200e-6, 2),  # wants 5 (0.5 % of 8 ms is 40 us), the delay bound allows 2
    (0.002, 200e-6, 10),  # wants 20, the bound allows 10
    (0.002, 40e-6, 4),  # a cheap exchange: 40 us / (0.5 % of 2 ms)
    (0.0002, 200e-6, 100),  # back to back: bounded by 20 ms of checks
])
def test_the_proposal_keeps_exchanges_within_budget_and_delay(interval_s: float, cost_s: float,
                                                               period: int) -> None:
    clock = Clock()
    cadence = CheckCadence(clock=clock)
    run_checks(cadence, clock, interval_s, cost_s, 50)
    assert cadence.proposal() == period
    assert period == 1 or cost_s / (period * interval_s) <= BUDGET * 1.001 \
        or period * interval_s <= MAX_DELAY_S + 1e-12


def test_the_agreed_period_decides_which_checks_exchange() -> None:
    # Whatever this rank would propose, the group's period decides: one exchange every
    # `agreed` checks, at the same calls on every rank.
    clock = Clock()
    cadence = CheckCadence(clock=clock)
    exchanged = run_checks(cadence, clock, 0.001, 200e-6, 12, agreed=3)
    assert exchanged == [True, False, False] * 4
    # A new group starts at period 1 (its first exchange agrees on nothing yet).
    cadence.exchanged(200e-6, 1)
    assert cadence.due()


@pytest.mark.slow
def test_real_peers_checking_back_to_back_space_their_exchanges_alike(
        etcd: str, unique_job: str) -> None:
    """Real etcd, two real peers, 400 checks back to back (nothing between them: checks far
    under 20 ms apart however loaded the machine is). Most return without an exchange, and
    both ranks exchanged at the same calls: the same counts on both."""
    from tests.helpers.procs import Cluster

    cluster = Cluster(etcd, unique_job, PEER_ELASTIC_MIN_NP=2, PEER_ELASTIC_MAX_NP=2,
                      WORKER_STEPS=400, WORKER_PLAIN=1)
    try:
        peers = cluster.start(2, module="tests.helpers.vote_worker")
        counts = []
        for p in peers:
            line = p.wait_line("CHECKS", timeout=120)
            exchanges, spaced = (int(n) for n in line.split()[1:])
            counts.append((exchanges, spaced))
            assert p.wait(timeout=60) == 0
        assert counts[0] == counts[1], counts
        exchanges, spaced = counts[0]
        assert exchanges + spaced == 400 and spaced > exchanges, counts
    finally:
        cluster.close()
