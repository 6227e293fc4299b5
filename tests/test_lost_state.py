"""The lost-state rule and rank 0's throttled mark (peer_elastic.state.lost_state), and a real job
in which every holder of the state dies at once while a standby lives."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from peer_elastic.records import StateRecord
from peer_elastic.state.agreement import StateVersion
from peer_elastic.state.lost_state import StateMarker, lost_state
from peer_elastic.testing import EtcdCluster
from tests.helpers.schedules import Pattern, Plan, ScheduleRunner

MARK = StateRecord(commits=40, generation=3, unix=1.0, written_by="h-1-abc")


def test_a_group_with_no_holder_in_a_run_whose_state_had_commits_lost_it() -> None:
    lost = lost_state(MARK, StateVersion())
    assert lost is not None
    assert (lost.commits, lost.generation, lost.holder, lost.resumed_commits) == (
        40, 3, "h-1-abc", 0)
    assert "40 commits" in lost.describe() and "snapshot_dir" in lost.describe()
    resumed = lost_state(MARK, StateVersion(2, 35, 4, 0))
    assert resumed is not None and resumed.resumed_commits == 35
    assert "durable snapshot, at 35 commits" in resumed.describe()


def test_the_first_group_of_a_run_lost_nothing() -> None:
    assert lost_state(None, StateVersion()) is None  # a fresh run: no mark yet


def test_rank_0_marks_commits_at_most_once_a_period() -> None:
    now = [0.0]
    said: list[tuple[int, int]] = []
    marker = StateMarker(lambda c, g: said.append((c, g)), period_s=1.0, clock=lambda: now[0])
    for commits in range(1, 6):  # five commits within 0.4 s: the first is said at once
        marker.committed(commits, 2)
        now[0] += 0.1
    assert said == [(1, 2)]
    now[0] = 1.05
    marker.committed(9, 3)
    assert said == [(1, 2), (9, 3)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killing_every_holder_of_the_state_while_a_standby_lives_is_reported(
        etcd_cluster: EtcdCluster, unique_job: str, tmp_path: Path) -> None:
    # Real etcd, three real peers: two train (max_np=2), one waits as a standby. Both that
    # train are SIGKILLed at once. The standby forms a group alone that holds no committed
    # state: it must say the state was lost (an error on its output, a state_lost event)
    # rather than start again in silence, and the job still ends exactly once.
    plan = Plan(-1, Pattern(record="batch", commit_every=2), [], peers=3, min_np=1, max_np=2)
    runner = ScheduleRunner(plan, etcd_cluster, unique_job, tmp_path / "work")
    try:
        runner.start()
        runner.wait_progress("the start", steps=20)
        roster = runner.roster()
        assert len(roster) == 2, [p.name for p in roster]
        (standby,) = [p for p in runner.running() if p not in roster]
        for p in roster:
            p.state = "killed"
            p.proc.signal(signal.SIGKILL)
        for p in roster:
            p.proc.proc.wait(timeout=30)
        runner.wait_progress("the loss of every holder", steps=5)
        result = runner.finish()
        assert not runner.verify(result), runner.verify(result)
        assert result["states_lost"] == 1, result  # the standby, now rank 0, counted it
        lost = [line for line in standby.proc.lines if "holds the run's newest training state" in line]
        assert lost and "ERROR" in lost[0] and "snapshot_dir" in lost[0], standby.tail(30)
        events = runner.cli("events")
        assert "state_lost" in events and "commits" in events, events
    finally:
        runner.close()
