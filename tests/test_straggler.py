"""Stragglers, piece by piece, on fake clocks: the waits, the meter, the scores, the
detector and the eviction rule; then the settings and the etcd writes on a real etcd. The
whole feature, with real peers, one throttled from outside: tests/test_straggler_job.py."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import ConfigError
from peer_elastic.etcd.admin import status_document, update_config
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.records import DrainRecord, EventRecord, PaceRecord, PeerPace, decode, encode
from peer_elastic.straggler.detector import Pace, StragglerDetector, holding_level
from peer_elastic.straggler.meter import PaceMeter
from peer_elastic.straggler.policy import Action, decide
from peer_elastic.straggler.reporting import (
    EVICTED_BY,
    Eviction,
    StragglerReport,
    StragglerReporter,
)
from peer_elastic.straggler.score import MIN_SHARE, GroupPace
from peer_elastic.straggler.settings import StragglerPolicy, StragglerSettings
from peer_elastic.straggler.waits import Tally, Totals

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- waits ---------------------------------------------------------------------------------------


def test_nested_waits_count_once_and_exempt_work_apart() -> None:
    clock = Clock()
    t = Tally(clock)
    t.enter_wait()
    clock.now += 1
    t.enter_wait()  # a marked wait around an optimizer step: the inner all-reduce is in it
    clock.now += 2
    t.leave_wait()
    clock.now += 1
    t.leave_wait()
    t.enter_exempt()
    clock.now += 5
    t.leave_exempt()
    assert t.totals() == Totals(4.0, 5.0)
    t.enter_wait()
    clock.now += 0.5
    assert t.totals() == Totals(4.5, 5.0)  # an open wait counts up to now
    t.leave_wait()
    t.leave_wait()  # unbalanced: ignored, never negative
    assert t.totals() == Totals(4.5, 5.0)


# -- the meter ------------------------------------------------------------------------------------


class FakeTally:
    def __init__(self) -> None:
        self.waited = self.exempt = 0.0

    def totals(self) -> Totals:
        return Totals(self.waited, self.exempt)


def test_the_meter_splits_each_span_into_own_time_and_waits() -> None:
    clock = Clock()
    tally = FakeTally()
    meter = PaceMeter(clock, lambda: tally)  # type: ignore[arg-type,return-value]
    meter.start()  # the group's first check
    assert meter.proposal() == 1
    # Ten checks of 100 ms each: 30 ms own work, 60 ms waiting, 10 ms exempt.
    clock.now += 1.0
    tally.waited += 0.6
    tally.exempt += 0.1
    sample = meter.take(checks=10)
    assert sample.checks == 10
    assert sample.own_s == pytest.approx(0.3) and sample.waited_s == pytest.approx(0.6)
    assert meter.proposal(every_s=1.0) == 10  # 1 s of 100 ms checks
    clock.now += 1.0  # the peer slows down: two checks of 500 ms; the next period shrinks
    assert meter.take(checks=2).own_s == pytest.approx(1.0)
    assert meter.proposal(every_s=1.0) == 2
    clock.now += 30  # a reset: a new group starts afresh
    meter.start()
    assert meter.proposal() == 1
    clock.now += 0.2
    assert meter.take(checks=1).own_s == pytest.approx(0.2)
    meter.start(fresh=False)  # measuring switched on again: the period stays
    assert meter.proposal(every_s=1.0) == 5


# -- scores ---------------------------------------------------------------------------------------


def test_scores_compare_each_peer_with_the_median_of_the_others() -> None:
    # 4 peers, rank 2 three times as slow: the others wait for it.
    pace = GroupPace((0.010, 0.010, 0.030, 0.011), (0.021, 0.021, 0.001, 0.020), 10)
    scores = pace.scores()
    assert scores[2] == pytest.approx(3.0)
    assert all(s < 1.2 for i, s in enumerate(scores) if i != 2)
    assert pace.slowest() == 2
    assert pace.step_s == pytest.approx(0.031)
    # Without it: the slowest other's own time + the smallest wait (the communication).
    assert pace.expected_step_without(2) == pytest.approx(0.011 + 0.001)
    # With two peers the median of the others is the other one: a 3x peer scores 3.
    two = GroupPace((0.01, 0.03), (0.021, 0.001), 5)
    assert two.scores() == pytest.approx((1 / 3, 3.0))
    assert GroupPace((0.01,), (0.0,), 1).scores() == (1.0,)
    # A step that is nearly all communication: the own times are tiny, and the median is
    # taken as at least MIN_SHARE of the step, so a 0.3 ms difference is no 4x straggler.
    comm = GroupPace((0.0001, 0.0001, 0.0004), (0.0103, 0.0103, 0.0100), 10)
    assert max(comm.scores()) == pytest.approx(0.0004 / (MIN_SHARE * comm.step_s))
    assert max(comm.scores()) < 1
    # A tie goes to the lowest rank, on every rank alike.
    assert GroupPace((0.03, 0.01, 0.03), (0.0, 0.02, 0.0), 1).slowest() == 0


# -- the detector ---------------------------------------------------------------------------------

SETTINGS = StragglerSettings(StragglerPolicy.REPORT, threshold=2.0, window_s=10.0,
                             cooldown_s=5.0)


def feed(detector: StragglerDetector, clock: Clock, scores: list[float]) -> list[Pace]:
    out = []
    for score in scores:
        clock.now += 1.0
        out.append(detector.observe(clock.now, score, SETTINGS))
    return [v.pace for v in out]


def test_nothing_is_judged_during_the_cooldown() -> None:
    clock = Clock()
    d = StragglerDetector(clock.now)
    assert set(feed(d, clock, [9.0] * 4)) == {Pace.UNJUDGED}
    assert feed(d, clock, [9.0]) == [Pace.SLOW]  # 5 s after the group formed


def test_a_slowdown_shorter_than_the_window_is_no_straggler() -> None:
    clock = Clock()
    d = StragglerDetector(clock.now - 100)
    # Two bouts of 9 s, back at the group's pace in between (two measurements: one alone
    # is taken for noise), and after.
    paces = feed(d, clock, [1.0, *[9.0] * 9, 1.0, 1.0, *[9.0] * 9, 1.0, 1.0])
    assert Pace.STRAGGLING not in paces and Pace.SLOW in paces


def test_a_run_of_slow_measurements_holds_through_noise_but_not_a_return_to_pace() -> None:
    clock = Clock()
    d = StragglerDetector(clock.now - 100)
    assert holding_level(2.0) == 1.5 and holding_level(3.0) == 2.0
    # A third-speed peer on a busy machine (measured under a load of 15): under the
    # threshold now and then, under the holding level once, never twice in a row.
    noisy = [2.95, 1.88, 0.97, 3.90, 3.86, 1.96, 3.02, 2.11, 3.15, 1.57, 2.5, 2.4]
    paces = feed(d, clock, noisy)
    assert paces[2] is Pace.SLOW and paces[-2:] == [Pace.STRAGGLING, Pace.STRAGGLING]
    # What it reports: the median of the run's measurements, not the last one (1.6).
    last = d.observe(clock.now + 1, 1.6, SETTINGS)
    assert last.pace is Pace.STRAGGLING
    assert last.score == pytest.approx(statistics.median([*noisy, 1.6]))
    # Back at the group's pace for two measurements: the run is over.
    assert feed(d, clock, [1.1, 1.0]) == [Pace.SLOW, Pace.STEADY]
    assert feed(d, clock, [2.5]) == [Pace.SLOW]
    # A healthy peer's noise (1.4, 1.8) never starts a run: only the threshold does.
    fresh = StragglerDetector(clock.now - 100)
    assert set(feed(fresh, clock, [1.4, 1.8, 1.9, 1.6] * 5)) == {Pace.STEADY}


def test_a_straggler_is_reported_once_per_episode() -> None:
    clock = Clock()
    d = StragglerDetector(clock.now - 100)
    verdicts = []
    for score in [3.0] * 15:
        clock.now += 1.0
        verdicts.append(d.observe(clock.now, score, SETTINGS))
    straggling = [v for v in verdicts if v.pace is Pace.STRAGGLING]
    assert straggling[0] is verdicts[10]  # 10 s (the window) after the first slow one
    assert [v.new_episode for v in straggling] == [True] + [False] * 4
    assert straggling[0].slow_since == pytest.approx(101.0)
    # A dip shorter than the window: the same episode, not reported again.
    feed(d, clock, [1.0] * 3)
    again = [d.observe(clock.now + i, 3.0, SETTINGS) for i in range(1, 12)]
    assert again[-1].pace is Pace.STRAGGLING and not any(v.new_episode for v in again)
    # Steady for a whole window (after the first measurement back, taken for a dip): the
    # episode ends, a later one is reported again.
    clock.now += 12
    feed(d, clock, [1.0] * 12)
    later = []
    for _ in range(11):
        clock.now += 1.0
        later.append(d.observe(clock.now, 3.0, SETTINGS))
    assert later[-1].new_episode


def test_a_run_dates_from_the_start_of_its_first_slow_span() -> None:
    # Each answer comes 0.3 s after its span of 1 s ended: the run began when the first
    # slow span did, so the window is over at the answer for the span ending 10 s later.
    clock = Clock()
    d = StragglerDetector(clock.now - 100)
    verdicts = []
    for score in [1.0, 3.0, *[3.0] * 10]:
        began = clock.now
        clock.now += 1.0
        verdicts.append(d.observe(clock.now + 0.3, score, SETTINGS, since=began))
    assert verdicts[1].slow_since == pytest.approx(101.0)  # the second span's start
    first = next(i for i, v in enumerate(verdicts) if v.pace is Pace.STRAGGLING)
    # Answered 10.3 s after the first slow span began; dated from its answer, a measurement
    # later.
    assert first == 10 and verdicts[first].new_episode
    # Never from before the cooldown's end, nor from after the answer came.
    young = StragglerDetector(0.0)
    assert young.observe(5.5, 3.0, SETTINGS, since=4.5).slow_since == 5.0
    assert young.observe(6.5, 3.0, SETTINGS, since=None).slow_since == 5.0
    late = StragglerDetector(-100.0)
    assert late.observe(2.0, 3.0, SETTINGS, since=7.0).slow_since == 2.0


# -- the eviction rule ----------------------------------------------------------------------------

SLOW3 = GroupPace((0.010, 0.010, 0.030, 0.010), (0.021, 0.021, 0.001, 0.021), 10)


def test_a_third_speed_peer_of_four_is_evicted() -> None:
    d = decide(StragglerPolicy.EVICT, SLOW3, rank=2, remaining=3, min_np=1)
    assert d.action is Action.EVICT
    assert d.rate_without > d.rate_now  # 3 / 11 ms > 4 / 31 ms
    assert "evicted" in d.describe()
    assert decide(StragglerPolicy.REPORT, SLOW3, 2, 3, 1).action is Action.REPORT


def test_no_eviction_below_min_np_nor_when_the_job_would_be_slower() -> None:
    assert decide(StragglerPolicy.EVICT, SLOW3, 2, remaining=3, min_np=4).action \
        is Action.KEEP_MIN_NP
    two = GroupPace((0.01, 0.03), (0.021, 0.001), 5)
    assert decide(StragglerPolicy.EVICT, two, 1, remaining=1, min_np=2).action \
        is Action.KEEP_MIN_NP
    # 20 % slower in a group of 4: 4 / 1.2t is more than 3 / t. It stays.
    mild = GroupPace((0.010, 0.010, 0.012, 0.010), (0.003, 0.003, 0.001, 0.003), 10)
    d = decide(StragglerPolicy.EVICT, mild, 2, remaining=3, min_np=1)
    assert d.action is Action.KEEP_FASTER_WITH and d.rate_without < d.rate_now
    # A standby would take its place (4 remain): replacing even a mild one pays.
    assert decide(StragglerPolicy.EVICT, mild, 2, remaining=4, min_np=1).action is Action.EVICT
    # Two stragglers: only the slowest goes now.
    both = GroupPace((0.010, 0.020, 0.040, 0.010), (0.031, 0.021, 0.001, 0.031), 10)
    assert decide(StragglerPolicy.EVICT, both, 1, 3, 1).action is Action.KEEP_NOT_SLOWEST
    assert decide(StragglerPolicy.EVICT, both, 2, 3, 1).action is Action.EVICT


# -- settings -------------------------------------------------------------------------------------


def test_straggler_settings_are_validated() -> None:
    cfg = JobSettings().resolved()
    assert StragglerSettings.of(cfg) == StragglerSettings()
    for bad, word in [({"straggler_policy": "kick"}, "straggler_policy"),
                      ({"straggler_threshold": 1.0}, "straggler_threshold"),
                      ({"straggler_window_s": 0.0}, "straggler_window_s"),
                      ({"straggler_cooldown_s": -1.0}, "straggler_cooldown_s")]:
        with pytest.raises(ConfigError, match=word):
            JobSettings(**bad).resolved()
    env = JobSettings.from_env({"PEER_ELASTIC_STRAGGLER_POLICY": "evict",
                                "PEER_ELASTIC_STRAGGLER_WINDOW": "30"}).resolved()
    assert StragglerSettings.of(env).policy is StragglerPolicy.EVICT
    assert env.straggler_window_s == 30.0


@pytest.fixture
def coordinator(etcd: str, unique_job: str) -> Iterator[Coordinator]:
    c = Coordinator(EtcdClient(etcd), unique_job, JobSettings(start_settle_s=0.1)).start()
    try:
        c.wait_generation(0, timeout=30)
        yield c
    finally:
        c.close()
        c.client.close()


@pytest.mark.timeout(120)
def test_the_settings_change_at_runtime_and_a_bad_value_is_one_line(
        coordinator: Coordinator, etcd: str, unique_job: str) -> None:
    cfg = update_config(coordinator.client, unique_job, {
        "straggler_policy": "evict", "straggler_threshold": "1.5",
        "straggler_window_s": "20", "straggler_cooldown_s": "5"})
    assert StragglerSettings.of(cfg) == StragglerSettings(StragglerPolicy.EVICT, 1.5, 20.0, 5.0)
    # The peer adopts it from the watched run record (its coordination thread; no event
    # to wait on but the config itself).
    deadline = time.monotonic() + 30
    while StragglerSettings.of(coordinator.config).policy is not StragglerPolicy.EVICT:
        assert time.monotonic() < deadline, "the new policy never reached the peer"
        time.sleep(0.05)
    r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "set", "--etcd", etcd,
                        "--job", unique_job, "straggler_policy=sometimes"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert r.stderr.strip().count("\n") == 0 and "straggler_policy" in r.stderr, r.stderr


# -- the etcd writes ------------------------------------------------------------------------------


def events(client: EtcdClient, coordinator: Coordinator) -> list[EventRecord]:
    assert coordinator.keys is not None
    kvs, _ = client.get_prefix(coordinator.keys.events_prefix)
    return [decode(EventRecord, kv.value, kv.key) for kv in sorted(kvs, key=lambda kv: kv.key)]


@pytest.mark.timeout(120)
def test_the_reporter_writes_the_pace_the_event_and_one_eviction(
        coordinator: Coordinator, unique_job: str) -> None:
    refused: list[bool] = []
    reporter = StragglerReporter(coordinator, on_not_evicted=lambda: refused.append(True),
                                 pace_every_s=0.1)
    me = coordinator.member_id
    try:
        reporter.offer_pace(PaceRecord(generation=1, unix=time.time(), step_s=0.03, peers=[
            PeerPace(member_id=me, score=3.0, own_s=0.03, waited_s=0.001)]))
        reporter.report(StragglerReport(me, "h1", 1, 3.0, "score 3.00"))
        reporter.evict(Eviction(me, 1, "score 3.00"))
        coordinator.view.wait_for(lambda s: s.pace is not None and me in s.drains, 10)
        reporter.evict(Eviction(me, 1, "again"))  # never a second eviction of one member
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused == [True]
    finally:
        reporter.stop()
    client = coordinator.client
    assert coordinator.keys is not None
    drain = decode(DrainRecord, client.get(coordinator.keys.drain(me)).value)
    assert drain.requested_by == EVICTED_BY
    found = events(client, coordinator)
    straggler = [e for e in found if e.kind == "straggler"]
    assert [(e.member_id, e.host, e.score) for e in straggler] == [(me, "h1", 3.0)]
    assert len([e for e in found if e.kind == "drain requested"]) == 1
    snap = coordinator.snapshot()
    doc = status_document(unique_job, snap, time.time())
    mine = next(m for m in doc["members"] if m["id"] == me)
    assert mine["straggler_score"] == 3.0 and mine["draining"]
    assert doc["pace"]["generation"] == 1


def test_a_pace_record_is_validated() -> None:
    good = PaceRecord(generation=1, unix=1.0, step_s=0.1,
                      peers=[PeerPace(member_id="a", score=1.0, own_s=0.1, waited_s=0.0)])
    assert decode(PaceRecord, encode(good)).peers[0].member_id == "a"
    for bad in (PaceRecord(generation=1, unix=1.0, step_s=math.nan),
                PaceRecord(generation=1, unix=1.0, step_s=0.1, peers=[
                    PeerPace(member_id="a/b", score=1.0)]),
                PaceRecord(generation=1, unix=1.0, step_s=0.1, peers=[
                    PeerPace(member_id="a", score=-1.0)])):
        with pytest.raises(Exception, match="invalid PaceRecord"):
            decode(PaceRecord, encode(bad), "k")


def test_a_view_without_a_pace_shows_none() -> None:
    from tests.helpers.views import snap

    doc = status_document("j", snap(["a-1"], (1, ["a-1"])), time.time())
    assert doc["pace"] is None and doc["members"][0]["straggler_score"] is None
