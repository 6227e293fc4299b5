"""Stragglers in a real job: four (or two) peers on a real etcd, one slowed from outside.

One peer is slowed, with no hook in the library (tests/helpers/throttle.py): either its
compute alone (a throttled GPU: its own work per step longer), or the whole process,
stopped and continued in a duty cycle (a slow machine: stopped two thirds of the time, so
it runs at a third of its speed, its waits in collectives too). What must happen:

* ``report`` (its compute slowed, the job to about a third of its speed): a ``straggler``
  event naming that peer, its host and its score, within the window plus one exchange
  (measurements come about once a second) and room for a loaded machine, once; ``status``
  shows its score; the job finishes exactly once;
* ``evict`` (the whole process, slowed to a seventh): the peer leaves at a check, exits 7,
  and the other three go on, nothing redone (the new generation's cause is a graceful
  leave), and the job finishes exactly once;
* a clean run of four full-speed peers: no event, no eviction;
* a slowdown shorter than the window (its compute slowed): no event, no eviction;
* two peers with ``min_np=2`` (its compute slowed): reported, never evicted.

Every test ends with the exactly-once oracle of tests/helpers/elastic_worker.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from peer_elastic.etcd.admin import current_run, job_status
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.records import EventRecord, GenerationCause, decode
from peer_elastic.straggler.meter import EXCHANGE_EVERY_S
from peer_elastic.straggler.policy import EXIT_STRAGGLER
from peer_elastic.straggler.reporting import EVICTED_BY
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.procs import Cluster, PeerProc, assert_exactly_once
from tests.helpers.throttle import DutyCycle, SlowCompute
from tests.helpers.worker_lines import (
    gen_lines,
    member_of,
    start_world_of,
    wait_more_steps,
    wait_world,
)

pytestmark = pytest.mark.slow
#: Alone: the tests that time detection (report), need a slowdown measured within seconds
#: (the brief one), or need the slowed peer to be the only slow thing on the machine
#: (evict: a stopped process waits in collectives as over a slow network, and a second
#: test's load blurs that further). The clean run and the min_np test run beside others on
#: purpose: a busy machine slows every peer of a job alike, and must neither make a
#: straggler of one nor hide a slowed one for a minute.
timed = pytest.mark.alone

WINDOW_S = 5.0
COOLDOWN_S = 2.0
THRESHOLD = 2.0
#: How many exchanges a straggler may be reported after the window: a run of slow
#: measurements dates from the start of its first slow span, and the span that holds the
#: slowdown's start may not score slow (part of its steps were fast), so the run can begin
#: one exchange after the slowdown; the verdict then comes with the first answer a window
#: later, which arrives one exchange after it was asked for. An exchange comes about every
#: EXCHANGE_EVERY_S, or every check when checks are further apart: on a loaded machine a
#: throttled job's checks are seconds apart (measured in the full suite: 9.7 s with checks
#: 1.0 s apart and a 5 s window).
LATE_EXCHANGES = 2
#: And room for the throttled peer to write the event, on a loaded machine.
LATE_S = 3.0
#: How long the clean run trains (four peers at full speed).
CLEAN_RUN_S = 60.0

SETTINGS = {
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_LOG_LEVEL": "INFO",  # member_of reads the "joined job" line
    "PEER_ELASTIC_STRAGGLER_WINDOW": WINDOW_S,
    "PEER_ELASTIC_STRAGGLER_COOLDOWN": COOLDOWN_S,
    "PEER_ELASTIC_STRAGGLER_THRESHOLD": THRESHOLD,
    "WORKER_SAMPLES": 480,
    "WORKER_EPOCHS": 1000,  # until the test ends it (WORKER_END_FILE): 600 s at the least
}

cluster = cluster_fixture(SETTINGS)


@pytest.fixture
def client(etcd: str) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd)
    try:
        yield c
    finally:
        c.close()


def events(client: EtcdClient, job: str) -> list[EventRecord]:
    """The current run's event log, oldest first."""
    run, _ = current_run(client, job)
    kvs, _ = client.get_prefix(RunKeys(job, run.run_id).events_prefix)
    return [decode(EventRecord, kv.value, kv.key) for kv in sorted(kvs, key=lambda kv: kv.key)]


def straggler_events(client: EtcdClient, job: str) -> list[EventRecord]:
    return [e for e in events(client, job)
            if e.kind == "straggler" or (e.kind == "drain requested" and EVICTED_BY in e.detail)]


def poll(what: str, find: Callable[[], object], timeout: float) -> object:
    """What ``find`` returns once it is truthy (etcd, read every 0.5 s: bounded)."""
    deadline = time.monotonic() + timeout
    while not (found := find()):
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)
    return found


def measured(client: EtcdClient, job: str, size: int) -> float:
    """Wait until the group has measured its pace and the cooldown is over, so that a
    slowdown from now on is judged from its start. Returns the slowdown that makes a
    peer's step about three times as long at that pace (for :class:`SlowCompute`)."""
    doc = poll("pace record", lambda: (d := job_status(client, job))["pace"] is not None
               and d["world_size"] == size and d, 60)
    time.sleep(COOLDOWN_S)  # the time must pass: nobody is judged before
    # A fixed slowdown would be another factor on every machine and load, and the first
    # exchange after a sudden F-fold slowdown comes about F seconds later (the period the
    # group agreed at the old pace runs out first): the tests time what follows it. The
    # pace's step is a check's, two of the worker's steps (it commits every second one).
    return max(0.1, doc["pace"]["step_s"])  # type: ignore[index]


def start(cluster: Cluster, n: int, end: Path, **env: object) -> list[PeerProc]:
    """``n`` peers training together, by rank."""
    return start_world_of(n, *cluster.start(n, WORKER_END_FILE=end, **env))


@timed
def test_a_throttled_peer_is_reported_once_within_the_window(
        cluster: Cluster, client: EtcdClient, unique_job: str, tmp_path: Path) -> None:
    end = tmp_path / "end"
    peers = start(cluster, 4, end, PEER_ELASTIC_STRAGGLER_POLICY="report",
                  WORKER_SLOW_DIR=tmp_path)
    slow = peers[2]
    member = member_of(slow)
    extra_s = measured(client, unique_job, 4)
    # Its compute slowed (a throttled GPU): each step about three times as long, the extra
    # all its own time. A whole process stopped and continued is found too (the tests
    # below), later: stopped inside a collective, its time counts as a wait, as a slow
    # network's would.
    with SlowCompute(tmp_path, slow.pid, extra_s=extra_s):
        began = time.time()
        found = poll("straggler event", lambda: straggler_events(client, unique_job), 60)
        status = job_status(client, unique_job)
        shown = poll("its score in status", lambda: next(
            (m["straggler_score"] for m in job_status(client, unique_job)["members"]
             if m["id"] == member and (m["straggler_score"] or 0) >= THRESHOLD), None), 30)
        wait_more_steps(peers[0], 3)  # it stays a straggler meanwhile: no second event
    event = found[0]  # type: ignore[index]
    assert (event.kind, event.member_id) == ("straggler", member)
    # Its score: the median of the slow run, at least the threshold.
    assert event.host and event.score >= THRESHOLD and "reported" in event.detail, event
    took = event.unix - began
    exchange_s = max(EXCHANGE_EVERY_S, status["pace"]["step_s"])  # a check, when longer
    assert took <= WINDOW_S + LATE_EXCHANGES * exchange_s + LATE_S, (
        f"reported {took:.1f} s after the slowdown began (checks {exchange_s:.1f} s apart)")
    assert shown >= THRESHOLD  # type: ignore[operator]
    end.touch()
    result = assert_exactly_once(peers)
    assert result["world"] == 4 and result["resets"] == 0, result
    assert [e.member_id for e in straggler_events(client, unique_job)] == [member]


@timed
def test_an_evicted_straggler_leaves_and_the_others_go_on_exactly_once(
        cluster: Cluster, client: EtcdClient, unique_job: str, tmp_path: Path) -> None:
    end = tmp_path / "end"
    peers = start(cluster, 4, end, PEER_ELASTIC_STRAGGLER_POLICY="evict")
    slow = peers[2]
    member = member_of(slow)
    others = [p for p in peers if p is not slow]
    measured(client, unique_job, 4)
    # Slower than a third: on a loaded machine every all-reduce waits for descheduled
    # processes, which the rule counts as communication that stays; a third-speed peer
    # then need not pay to evict (a run under a load of 22 said so, rightly by its numbers).
    with DutyCycle(slow.pid, stopped_s=0.3, running_s=0.05):
        code = slow.wait(120)
    assert code == EXIT_STRAGGLER, slow.output()
    assert "as a straggler" in slow.output()
    for p in others:
        wait_world(p, 3, 60, seen=1)
    wait_more_steps(others[0], 5)
    gen = job_status(client, unique_job)
    assert gen["world_size"] == 3 and member not in {m["id"] for m in gen["members"]}
    # A graceful leave: the generation without it formed because it left, not because a
    # collective broke (nothing rolled back, nothing redone).
    three = [e for e in events(client, unique_job) if e.kind == "generation"][-1]
    assert three.world_size == 3, three
    assert list(three.causes) == [GenerationCause.GENERATION_CAUSE_LEFT], three
    kinds = [(e.kind, e.member_id) for e in straggler_events(client, unique_job)]
    assert kinds == [("straggler", member), ("drain requested", member)], kinds
    end.touch()
    result = assert_exactly_once(others)
    assert result["world"] == 3 and result["resets"] == 1, result
    assert [size for _, _, size in gen_lines(others[0])] == [4, 3]


def test_a_clean_run_reports_nothing(cluster: Cluster, client: EtcdClient, unique_job: str,
                                     tmp_path: Path) -> None:
    end = tmp_path / "end"
    peers = start(cluster, 4, end, PEER_ELASTIC_STRAGGLER_POLICY="evict")
    measured(client, unique_job, 4)
    deadline = time.monotonic() + CLEAN_RUN_S
    while time.monotonic() < deadline:  # it trains; a false straggler would leave (exit 7)
        assert all(p.proc.poll() is None for p in peers), [p.output() for p in peers]
        wait_more_steps(peers[0], 5)
    assert straggler_events(client, unique_job) == []
    end.touch()
    result = assert_exactly_once(peers)
    assert result["world"] == 4 and result["resets"] == 0, result


@timed
def test_a_slowdown_shorter_than_the_window_is_no_straggler(
        cluster: Cluster, client: EtcdClient, unique_job: str, tmp_path: Path) -> None:
    end = tmp_path / "end"
    window = 16.0
    peers = start(cluster, 4, end, PEER_ELASTIC_STRAGGLER_POLICY="evict",
                  PEER_ELASTIC_STRAGGLER_WINDOW=window, WORKER_SLOW_DIR=tmp_path)
    slow = peers[1]
    member = member_of(slow)
    extra_s = measured(client, unique_job, 4)
    # Its compute slowed, as in the report test: measured slow within seconds, every time.
    with SlowCompute(tmp_path, slow.pid, extra_s=extra_s):
        # Slow long enough to be measured slow (its score shown), well under the window.
        poll("its slow score in status", lambda: any(
            m["id"] == member and (m["straggler_score"] or 0) >= THRESHOLD
            for m in job_status(client, unique_job)["members"]), window / 2)
        time.sleep(1.0)
    wait_more_steps(peers[0], 5)
    time.sleep(window)  # past the window: a straggler would have been found by now
    assert straggler_events(client, unique_job) == []
    end.touch()
    result = assert_exactly_once(peers)
    assert result["world"] == 4 and result["resets"] == 0, result


def test_two_peers_at_min_np_keep_their_straggler(
        cluster: Cluster, client: EtcdClient, unique_job: str, tmp_path: Path) -> None:
    end = tmp_path / "end"
    peers = start(cluster, 2, end, PEER_ELASTIC_STRAGGLER_POLICY="evict",
                  PEER_ELASTIC_MIN_NP=2, WORKER_SLOW_DIR=tmp_path)
    slow = peers[1]
    member = member_of(slow)
    extra_s = measured(client, unique_job, 2)
    with SlowCompute(tmp_path, slow.pid, extra_s=extra_s):
        found = poll("straggler event", lambda: straggler_events(client, unique_job), 60)
        wait_more_steps(peers[0], 5)
    event = found[0]  # type: ignore[index]
    assert (event.kind, event.member_id) == ("straggler", member)
    assert "below min_np=2" in event.detail, event.detail
    end.touch()
    result = assert_exactly_once(peers)
    assert result["world"] == 2 and result["resets"] == 0, result
    assert [e.kind for e in straggler_events(client, unique_job)] == ["straggler"]
