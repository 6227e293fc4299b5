"""Regression tests for issue 9's three measured scenarios, each on a real etcd cluster with
real peer processes and the exactly-once oracle (tests/helpers/elastic_worker.py): every
sample of every epoch trained exactly once, every rank bit-identical, plain values consistent
with the model, every peer not SIGKILLed exited 0, and no process left.

(a) 3 peers, ``commit()`` every 5 steps and ``check_host_updates()`` at the others; events
    join, SIGTERM, SIGKILL of a non-leader, join, SIGKILL of the leader, join.
(b) ``peer-elastic set max_np=2`` early in an epoch, a few dozen steps, ``set max_np=3``,
    with ``check_host_updates()`` at every step and a commit only at each epoch end.
(c) the training thread of one of 3 peers blocks forever while its process lives: the others
    must train again within ``hang_timeout_s`` + 10 s.

The scripts run through tests/helpers/schedules.py's runner, so a failure prints the
pattern, the events applied, the oracle's numbers and every peer's log tail.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from peer_elastic.testing import EtcdCluster
from tests.helpers.schedules import (
    Outcome,
    Pattern,
    Plan,
    ScheduleRunner,
    SEvent,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

def wait_early(runner: ScheduleRunner) -> None:
    since = time.monotonic()
    runner.wait_for("a STEP line early in an epoch", lambda: any(
        t >= since and b <= 10 for (_, b, _), t in runner.steps.items()))


def run_script(etcd: EtcdCluster, job: str, tmp_path: Path, plan: Plan,
               script: list[SEvent | str], **settings: object) -> Outcome:
    """Start ``plan``'s peers, apply ``script`` (events, or ``"early"``: wait until the job
    is at most 10 batches into an epoch), end the job and verify it."""
    runner = ScheduleRunner(plan, etcd, job, tmp_path / "work", settings=settings)
    oc = Outcome(plan, runner)
    try:
        runner.start()
        for item in script:
            if item == "early":
                wait_early(runner)
            else:
                assert isinstance(item, SEvent)
                runner.apply(item)
        oc.result = runner.finish()
        oc.problems = runner.verify(oc.result)
    except AssertionError as exc:  # ChaosFailure included: the message names everything
        oc.problems = [str(exc)]
    finally:
        runner.dump(tmp_path / "logs")
        runner.close()
    print(oc.report())
    return oc


def expect_pass(oc: Outcome) -> None:
    if oc.problems:
        pytest.fail(oc.report(), pytrace=False)


SCENARIO_A = [SEvent(0, "add"), SEvent(1, "term", target="other"),
              SEvent(2, "kill", target="other"), SEvent(3, "add"),
              SEvent(4, "kill", target="leader"), SEvent(5, "add")]


# record_batch under the same events is covered by test_elastic.py and the schedules; the
# measured failures were with progress recorded on one rank only.
@pytest.mark.parametrize("record", ["indices", "local"])
def test_a_rare_commits_checks_between_join_leave_crashes(
        record: str, etcd_cluster: EtcdCluster, unique_job: str, tmp_path: Path) -> None:
    plan = Plan(-1, Pattern(record=record, commit_every=5, check_every=1, plain=True),
                SCENARIO_A, peers=4, min_np=2, max_np=4, start=3)
    expect_pass(run_script(etcd_cluster, unique_job, tmp_path, plan, SCENARIO_A,
                           WORKER_SAMPLES=480))


# The failure reproduced with record_batch too (a stale state is stale however progress is
# recorded); record_indices also needs the merge before the park.
@pytest.mark.parametrize("record", ["indices"])
def test_b_max_np_down_and_up_between_commits(
        record: str, etcd_cluster: EtcdCluster, unique_job: str, tmp_path: Path) -> None:
    events = [SEvent(0, "set_max", value=2), SEvent(1, "train", value=6),
              SEvent(2, "set_max", value=3)]
    # A commit only at each epoch end (1440 samples: 120 batches at world 3, 180 at 2), and
    # the resize starts early in an epoch: no commit between the park and the return.
    plan = Plan(-1, Pattern(record=record, commit_every=10**6, check_every=1, plain=True),
                events, peers=3, min_np=2, max_np=3)
    expect_pass(run_script(etcd_cluster, unique_job, tmp_path, plan,
                           ["early", *events], WORKER_SAMPLES=1440))


# tests/test_liveness.py covers the hang with record_batch.
@pytest.mark.parametrize("record", ["indices"])
def test_c_hung_training_thread(record: str, etcd_cluster: EtcdCluster, unique_job: str,
                                tmp_path: Path) -> None:
    events = [SEvent(0, "hang"), SEvent(1, "train", value=3)]
    plan = Plan(-1, Pattern(record=record, commit_every=2, check_every=0, plain=True),
                events, peers=3, min_np=2, max_np=3)
    expect_pass(run_script(etcd_cluster, unique_job, tmp_path, plan, events,
                           WORKER_SAMPLES=480))
