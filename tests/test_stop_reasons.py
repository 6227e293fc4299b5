"""stop_reason: the first cause that holds, in StopCause order, whatever collection of causes
is asked about (unit tests on fakes; every stop path also runs on real peers elsewhere)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from peer_elastic.etcd.stop import ALL_CAUSES, RESET_NOW, GroupId, StopCause, stop_reason


def _coord(error: Exception | None = None, incarnation: int = 1) -> Any:
    return SimpleNamespace(error=error, incarnation=incarnation, member_id="m", job="j",
                           drain_requested=threading.Event())


def _snap(done: object = None) -> Any:
    return SimpleNamespace(generation=None, done=done, members={"m": object()})


def test_the_most_severe_cause_that_holds_wins_for_any_collection_of_causes() -> None:
    coord, snap = _coord(error=RuntimeError("boom")), _snap(done=object())
    for causes in (ALL_CAUSES, RESET_NOW, tuple(StopCause), [StopCause.JOB_DONE, StopCause.FATAL],
                   {StopCause.JOB_DONE, StopCause.FATAL}):
        reason = stop_reason(coord, None, snap, causes=causes)
        assert reason is not None and reason.cause is StopCause.FATAL, causes
    reason = stop_reason(coord, None, snap, causes=[StopCause.JOB_DONE])
    assert reason is not None and reason.cause is StopCause.JOB_DONE


def test_group_causes_need_a_group_and_nothing_holds_in_a_healthy_job() -> None:
    group = GroupId(generation=3, roster=("m",), incarnation=1)
    assert stop_reason(_coord(), None, _snap(), causes=RESET_NOW) is None
    assert stop_reason(_coord(), group, _snap(), causes=RESET_NOW) is None
    reason = stop_reason(_coord(incarnation=2), group, _snap(), causes=RESET_NOW)
    assert reason is not None and reason.cause is StopCause.LEASE_LOST
    assert stop_reason(_coord(incarnation=2), None, _snap(), causes=RESET_NOW) is None


def test_a_cut_off_roster_member_means_the_group_cannot_complete_after_a_lost_one() -> None:
    from peer_elastic.etcd.stop import CANNOT_COMPLETE

    group = GroupId(generation=3, roster=("m", "x", "y"), incarnation=1)
    snap = SimpleNamespace(generation=None, done=None, members={"m": 1, "x": 1, "y": 1},
                           cut_off=lambda: frozenset({"y", "z"}))
    reason = stop_reason(_coord(), group, snap, causes=CANNOT_COMPLETE)
    assert reason is not None and reason.cause is StopCause.CUT_OFF and reason.lost == ("y",)
    assert "y of generation 3 is cut off" in reason.detail
    snap.members = {"m": 1, "y": 1}  # x's lease is gone too: that is said first
    reason = stop_reason(_coord(), group, snap, causes=CANNOT_COMPLETE)
    assert reason is not None and reason.cause is StopCause.PEER_LOST
    snap.cut_off = lambda: frozenset({"z"})  # a member of no concern to this group
    snap.members = {"m": 1, "x": 1, "y": 1}
    assert stop_reason(_coord(), group, snap, causes=CANNOT_COMPLETE) is None


def test_the_end_of_participation_is_the_fatal_error_the_jobs_end_or_a_leave() -> None:
    from peer_elastic.errors import JobFinished, LeaveRequested
    from peer_elastic.etcd.stop import participation_end
    from peer_elastic.records import DoneCause, DoneRecord

    assert participation_end(_coord(), _snap()) is None
    boom = RuntimeError("boom")
    assert participation_end(_coord(error=boom), _snap(done=object())) is boom
    done = DoneRecord(success=True, cause=DoneCause.DONE_CAUSE_RETURNED)
    assert isinstance(participation_end(_coord(), _snap(done=done)), JobFinished)
    coord = _coord()
    coord.drain_requested.set()  # drained, and the newest roster no longer lists it
    assert isinstance(participation_end(coord, _snap()), LeaveRequested)
