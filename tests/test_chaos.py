"""Seeded chaos with the exactly-once oracle.

Four peers of ``tests/helpers/elastic_worker.py`` plus a standby (``max_np=4``) train over a
3-member etcd cluster while a seeded schedule applies ``$PEER_ELASTIC_CHAOS_EVENTS`` (default
6, every kind at least once; 12 or more: every kind twice; the suite's seeded schedules in
test_schedules.py add more) random events: SIGKILL, SIGTERM, a new peer, SIGSTOP past the lease TTL then SIGCONT,
kill (or graceful stop) and restart of one etcd member, and of all three. At the end the job
has completed, every sample of every epoch was counted exactly once in the committed model,
all ranks are bit-identical, every peer not SIGKILLed exited 0, and no peer process is left.

The seed is printed (``CHAOS SEED <seed>``) and is part of every failure message; replay a
run with ``PEER_ELASTIC_CHAOS_SEED=<seed>``. Every peer's full output and the etcd logs are
kept under the test's tmp_path (``chaos-<seed>/``). Schedule and runner: tests/helpers/chaos.py.

    python -m pytest tests/test_chaos.py -n 0 -s                               # ~30 s, each kind
    PEER_ELASTIC_CHAOS_SEED=1234 python -m pytest tests/test_chaos.py -n 0 -s  # replay a seed
    PEER_ELASTIC_CHAOS_EVENTS=200 python -m pytest tests/test_chaos.py -n 0 -s # soak (~13 min)
    python benchmarks/soak.py --events 200 [--seed N] [--runs K]               # the same, no pytest
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from peer_elastic.testing import EtcdCluster
from tests.helpers.chaos import (
    DEPARTURES,
    KINDS,
    events_from_env,
    make_schedule,
    run_chaos,
    seed_from_env,
)
from tests.helpers.procs import Cluster
from tests.helpers.stall_stacks import StallStacks

pytestmark = pytest.mark.slow

# The suite's run: every kind at least once (make_schedule pads), about half a minute; the
# seeded schedules of test_schedules.py draw the same kinds and more. A longer run asked for
# with PEER_ELASTIC_CHAOS_EVENTS gets every kind at least twice.
N_EVENTS = events_from_env(6)
MIN_EACH = 1 if N_EVENTS < 12 else 2


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**31 - 1])
@pytest.mark.parametrize("n_events", [8, 30, 200])
def test_schedule_is_seeded_and_keeps_its_constraints(seed: int, n_events: int) -> None:
    schedule = make_schedule(seed, n_events)
    assert schedule == make_schedule(seed, n_events)  # a pure function of the seed
    assert len(schedule) >= n_events
    counts = Counter(e.kind for e in schedule)
    assert all(counts[k] >= 2 for k in KINDS), counts
    live = 5
    for e in schedule:
        if e.kind in DEPARTURES or e.kind == "stop":
            assert live - 1 >= 2, (seed, e)  # never below min_np (a stop lasts one event)
        if e.kind in DEPARTURES:
            live -= 1
        elif e.kind == "add":
            live += 1
            assert live <= 5, (seed, e)  # max_np roster peers + one standby at most
        if e.kind == "stop":
            assert e.hold_s > 3.0  # past the lease TTL
    assert live == 5  # ends with the standby back
    for kind in ("etcd_member", "etcd_all"):  # both SIGKILL and graceful etcd stops
        assert {e.hard for e in schedule if e.kind == kind} == {True, False}, (seed, kind)


@pytest.mark.timeout(300 + 25 * N_EVENTS)
def test_chaos_exactly_once(etcd_cluster: EtcdCluster, unique_job: str, tmp_path: Path,
                            record_property: Callable[[str, object], None]) -> None:
    seed = seed_from_env()
    record_property("chaos_seed", seed)
    runner, result, problems = run_chaos(etcd_cluster, unique_job, seed, N_EVENTS,
                                         log_dir=tmp_path / f"chaos-{seed}", min_each=MIN_EACH)
    tag = runner.tag()
    assert not problems, f"{tag}:\n" + "\n".join(problems) + "\nevents:\n" + runner.history()
    assert result["exact"] and result["identical"], f"{tag}: {result}"
    assert len(runner.applied) >= N_EVENTS, f"{tag}: {len(runner.applied)} applied"
    applied = Counter(a.event.kind for a in runner.applied)
    assert all(applied[k] >= MIN_EACH for k in KINDS), f"{tag}: {applied}"


def test_a_peer_that_does_not_exit_in_time_is_reported_with_its_stacks(unique_job: str) -> None:
    # The harness's own diagnosis (tests/helpers/procs.py): a test that gives up on a silent
    # peer says where each of its threads is, not only what it printed.
    cluster = Cluster("127.0.0.1:9", unique_job, PEER_ELASTIC_LOG_LEVEL="INFO")
    try:
        (p,) = cluster.start(1)  # nothing answers at that address: join() keeps retrying
        p.wait_line("", timeout=60)  # main() runs, so its SIGUSR1 handler is in place
        with pytest.raises(AssertionError) as failure:
            p.wait(timeout=0.5)
        report = str(failure.value)
        assert "did not exit in 0.5 s" in report and "--- stacks:" in report, report
        assert "Current thread" in report and "elastic_worker.py" in report, report
        if shutil.which("gdb"):  # and the native ones, for a hang below Python (exit, C++)
            assert f"--- native stacks of {p.pid}:" in report and "\nThread 1 " in report, report
        assert p.proc.poll() is None  # asked, not killed
    finally:
        cluster.close()


def test_a_stalled_worker_writes_its_stacks_once_per_stall(capfd: pytest.CaptureFixture[str]
                                                           ) -> None:
    # WORKER_STACKS_AFTER_S in a soak: a Python thread that dumps with the GIL held
    # (faulthandler's C timer crashed a peer mid-dump, seed 295988996).
    stacks = StallStacks(0.2)
    try:
        assert not stacks.wait_dumped(0.6), "nothing before the first batch"
        stacks.beat()
        assert stacks.wait_dumped(30)
        assert not stacks.wait_dumped(0.6), "once per stall"
        stacks.beat()
        assert stacks.wait_dumped(30), "a new stall, a new dump"
    finally:
        stacks.close()
    assert not stacks.running()
    err = capfd.readouterr().err
    assert err.count("stacks of all threads") == 2, err
    assert "test_a_stalled_worker_writes_its_stacks_once_per_stall" in err, err
