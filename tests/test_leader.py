"""Leader decisions with a fake writer and a fake clock, and what a done record means (no etcd)."""

from __future__ import annotations

import dataclasses

import pytest

from peer_elastic.errors import (
    ElasticTimeout,
    EtcdRequestTooLarge,
    JobFinished,
    PeerElasticError,
    ResetLimitExceeded,
)
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.done import done_error
from peer_elastic.etcd.leader import Leader
from peer_elastic.etcd.view import Departure
from peer_elastic.etcd.writer import Written
from peer_elastic.records import (
    DoneCause,
    DoneRecord,
    HostRecord,
)
from tests.helpers.fakes import FakeWrites
from tests.helpers.views import snap


def leader(member_id: str = "a-1", **kw) -> tuple[Leader, FakeWrites]:  # noqa: ANN003
    w = FakeWrites(member_id, **kw)
    return Leader("job", w, wall=lambda: 1000.0), w


def test_only_the_oldest_eligible_member_writes() -> None:
    s = snap(["a-1", "b-1"], min_np=2)
    lb, wb = leader("b-1")
    assert lb.step(s, 5.0) is None and wb.calls == []
    la, wa = leader("a-1")
    la.step(s, 5.0)
    assert wa.calls == [("generation", 1, ("a-1", "b-1"), 1000.0 - 5.0)]
    assert la.counters.generations_written == 1


def test_waiting_leader_says_when_to_look_again() -> None:
    s = snap(["a-1", "b-1"], changed_at=10.0, min_np=2)
    la, wa = leader()
    assert la.step(s, 10.2) == pytest.approx(11.0)  # start_settle_s after the last change
    assert wa.calls == []
    # A generation nobody else acked: look again when its silence could start.
    s = snap(["a-1", "b-1"], gen=(1, ["a-1", "b-1"]), ready=["a-1"], min_np=2)
    assert la.step(s, 20.0) == pytest.approx(20.0 + s.run.config.join_timeout_s)


def test_silent_members_are_dropped_after_join_timeout_and_their_leases_revoked() -> None:
    s = snap(["a-1", "b-1", "c-1"], gen=(2, ["a-1", "b-1", "c-1"]), ready=["a-1", "c-1"])
    la, wa = leader()
    timeout = s.run.config.join_timeout_s
    la.step(s, 100.0)  # first sight of generation 2 starts its clock
    la.step(s, 100.0 + timeout - 0.01)
    assert wa.calls == []
    la.step(s, 100.0 + timeout)
    assert wa.calls == [("generation", 3, ("a-1", "c-1"), 1000.0), ("revoke", 11)]
    assert la.counters.dropped == 1


def test_an_election_the_writer_had_not_heard_of_drops_nobody() -> None:
    """A member's ack stalled in an etcd leader election that the writer's own connection
    did not see: before dropping on the clock alone, the writer reads etcd once, learns of
    the election (a new raft term), and waits for etcd to settle instead."""
    s = snap(["a-1", "b-1", "c-1"], gen=(2, ["a-1", "b-1", "c-1"]), ready=["a-1", "c-1"])
    la, wa = leader()
    timeout = s.run.config.join_timeout_s
    la.step(s, 100.0)
    assert wa.rechecks == 0  # nobody silent: no read
    wa.recheck_reveals = 100.0 + timeout + 4.0  # settled 4 s after the read
    assert la.step(s, 100.0 + timeout) == pytest.approx(100.0 + 2 * timeout + 4.0)
    assert wa.rechecks == 1 and wa.calls == []  # b-1 is not dropped
    lb, wb = leader("b-1")  # a non-writer never reads
    lb.step(s, 100.0)
    lb.step(s, 100.0 + timeout)
    assert wb.rechecks == 0
    # Silent past the settled etcd: dropped (the read finds nothing new this time).
    wa.recheck_reveals = None
    la.step(s, 100.0 + 2 * timeout + 4.0)
    assert wa.calls[0] == ("generation", 3, ("a-1", "c-1"), 1000.0)


def test_elastic_timeout_fails_the_run_on_the_fake_clock() -> None:
    s = snap(["a-1"], gen=(1, []), min_np=2, elastic_timeout_s=30)
    la, wa = leader()
    la.step(s, 0.0)
    la.step(s, 30.0)
    assert ("done", False, DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT) not in wa.calls
    with pytest.raises(ElasticTimeout):
        la.step(s, 30.5)
    assert ("done", False, DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT) in wa.calls


def test_reset_limit_ends_the_run_instead_of_writing_a_generation() -> None:
    s = snap(["a-1", "b-1"], gen=(3, ["a-1"]), reset_limit=2)
    la, wa = leader()
    la.step(s, 100.0)
    assert wa.calls == [("done", False, DoneCause.DONE_CAUSE_RESET_LIMIT)]


def test_a_lost_race_is_counted() -> None:
    la, _ = leader(written=Written.LOST)
    la.step(snap(["a-1"], min_np=1), 5.0)
    assert la.counters == CoordinatorCounters(generations_written=0, cas_lost=1, dropped=0)


def test_too_large_halves_the_roster_budget_or_fails_when_minimal() -> None:
    la, wa = leader("h0-1", written=EtcdRequestTooLarge("too large"))
    members = [f"h{i}-1" for i in range(4)]
    la.step(snap(members, min_np=1), 5.0)
    assert la.roster_budget == 4 * 7 // 2 and ("event", "generation too large") in wa.calls
    la, _ = leader(written=EtcdRequestTooLarge("too large"))
    with pytest.raises(PeerElasticError, match="max-request-bytes"):
        la.step(snap(["a-1"], min_np=1), 5.0)


def test_failed_departures_are_counted_per_host_then_blacklisted() -> None:
    gone = [Departure(1, "x-1", "hostx", False), Departure(2, "y-1", "hosty", True)]
    s = snap(["a-1"], gen=(1, ["a-1"]), departures=gone, blacklist_after=2,
             failures={"hostx": (HostRecord(host="hostx", failures=1), 7)})
    la, wa = leader()
    la.step(s, 5.0)
    assert ("event", "expired") in wa.calls and ("blacklist", "hostx", 2) in wa.calls
    assert not any(c[0] == "failure" or c[1:2] == ("hosty",) for c in wa.calls)
    wa.calls.clear()
    la.step(s, 6.0)  # the same departures are not counted twice
    assert wa.calls == []


def test_event_log_is_pruned_once_ten_percent_over_the_cap() -> None:
    la, wa = leader()
    la.events_kept = 100
    la.step(snap(["a-1"], gen=(1, ["a-1"]), event_count=110), 5.0)
    assert wa.calls == []
    s = snap(["a-1"], gen=(1, ["a-1"]), event_count=111)
    la.step(s, 5.0)
    la.step(dataclasses.replace(s, version=2), 6.0)  # not again before the view saw it
    assert wa.calls == [("prune", 100)]


def test_event_log_is_pruned_again_once_the_view_saw_the_last_prune() -> None:
    la, wa = leader()
    la.events_kept = 100
    wa.pruned_at = 5  # the view has seen the prune from revision 5 on
    s = snap(["a-1"], gen=(1, ["a-1"]), ready=["a-1"], event_count=120)
    la.step(dataclasses.replace(s, revision=3), 5.0)
    la.step(dataclasses.replace(s, revision=4, event_count=130), 5.0)  # stale: before 5
    assert wa.calls == [("prune", 100)]
    # Regrown after the prune to exactly the count the first prune was decided at.
    la.step(dataclasses.replace(s, revision=5, event_count=100), 6.0)
    la.step(dataclasses.replace(s, revision=7, event_count=120), 6.0)
    assert wa.calls == [("prune", 100)] * 2


def test_a_view_whose_revision_went_back_is_taken_as_fresh() -> None:
    la, wa = leader()
    la.events_kept = 100
    wa.pruned_at = 50
    s = snap(["a-1"], gen=(1, ["a-1"]), ready=["a-1"], event_count=120)
    la.step(dataclasses.replace(s, revision=10), 5.0)
    la.step(dataclasses.replace(s, revision=40), 5.0)  # stale: not yet at 50
    assert wa.calls == [("prune", 100)]
    # etcd was replaced (restored from a backup): its revisions start lower again.
    la.step(dataclasses.replace(s, revision=3), 6.0)
    assert wa.calls == [("prune", 100)] * 2


@pytest.mark.parametrize(("cause", "reason", "error"), [
    (DoneCause.DONE_CAUSE_RESET_LIMIT, "x", ResetLimitExceeded),
    (DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT, "x", ElasticTimeout),
    (DoneCause.DONE_CAUSE_RETURNED, "reset limit in the text decides nothing", JobFinished),
    # Records from writers before DoneRecord.cause: their reasons began with these words.
    (DoneCause.DONE_CAUSE_UNSPECIFIED, "reset limit exceeded: 3 resets", ResetLimitExceeded),
    (DoneCause.DONE_CAUSE_UNSPECIFIED, "elastic timeout: fewer than 2", ElasticTimeout),
])
def test_a_done_records_cause_picks_the_error(cause: int, reason: str, error: type) -> None:
    err = done_error("job", DoneRecord(success=False, reason=reason, cause=cause))
    assert type(err) is error
    assert type(done_error("job", DoneRecord(success=True, cause=cause))) is JobFinished


def test_when_every_member_is_drained_the_oldest_writes_the_empty_roster() -> None:
    # peer-elastic drain --all: nobody is eligible, yet someone must let them all leave.
    s = dataclasses.replace(snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1"]), ready=["a-1", "b-1"]),
                            drains=frozenset({"a-1", "b-1"}))
    lb, wb = leader("b-1")
    lb.step(s, 100.0)
    assert wb.calls == []  # not the oldest
    la, wa = leader("a-1")
    la.step(s, 100.0)
    assert [c[:3] for c in wa.calls if c[0] == "generation"] == [("generation", 3, ())]
