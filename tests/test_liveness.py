"""Training-thread liveness: a hung training thread fences its peer; nothing else does.

Unit tests of the detector with a fake clock and a fake stack probe, of the stack probe on
real threads, of the response (stacks, fence, exit code), of the settings and records, and
of the roster's reason; then real peers on gloo over a real etcd: one peer's training
thread blocks for good, a slow step, and a peer frozen while the others wait for it in a
collective.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import ConfigError, RecordError
from peer_elastic.liveness import (
    EXIT_HUNG,
    HangDetector,
    HangMonitor,
    HangReport,
    TrainingLiveness,
    current_frame_of,
    frame_waits_on_peers,
    respond_to_hang,
    sample_period,
    thread_waits_on_peers,
)
from peer_elastic.records import FenceCause, FenceRecord, GenerationCause, decode, encode
from peer_elastic.torch.transport import collectives, direct_all_reduce, layout_check
from tests.helpers import views
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.fakes import FakeClock
from tests.helpers.procs import Cluster, PeerProc
from tests.helpers.worker_lines import results


class Rig:
    """A detector over a fake clock; ``waiting`` is what the stack probe answers."""

    def __init__(self, timeout: float = 3.0) -> None:
        self.clock = FakeClock()
        self.timeout = timeout
        self.first_step = 0.0  # hang_first_step_s: 0 = no allowance of its own
        self.waiting = False
        self.live = TrainingLiveness(self.clock)
        self.det = HangDetector(self.live, lambda: self.timeout, clock=self.clock,
                                first_step_s=lambda: self.first_step,
                                waits_on_peers=lambda tid: self.waiting)

    def run_for(self, seconds: float) -> bool:
        """Poll as the monitor would (at each planned time) for ``seconds``; True if hung."""
        end = self.clock.now + seconds
        while True:
            v = self.det.poll()
            if v.hung:
                return True
            nxt = v.look_again_at
            if nxt > end:
                self.clock.now = end
                return False
            self.clock.now = max(nxt, self.clock.now)


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_stuck_in_own_code_is_hung_after_the_timeout_and_not_before(rig: Rig) -> None:
    with rig.live.training():
        assert not rig.run_for(2.9)
        assert rig.run_for(0.2)
        v = rig.det.poll()
        assert v.hung and 3.0 <= v.idle_s < 3.3


def test_steps_under_the_timeout_never_are(rig: Rig) -> None:
    with rig.live.training():
        for _ in range(100):  # steps of 2.9 s against a 3 s timeout: never a hang
            assert not rig.run_for(2.9)
            rig.live.stepped()


def test_time_in_a_marked_collective_is_not_counted(rig: Rig) -> None:
    with rig.live.training():
        assert not rig.run_for(2.0)
        with rig.live.collective():  # the others are slow: we wait on them for long
            assert not rig.run_for(60.0)
        assert not rig.run_for(2.9)  # the clock restarted when the collective ended
        assert rig.run_for(0.2)


def test_time_waiting_on_peers_seen_on_the_stack_is_not_counted(rig: Rig) -> None:
    with rig.live.training():
        assert not rig.run_for(1.0)
        rig.waiting = True  # blocked in dist.all_reduce, say, on a hung peer
        assert not rig.run_for(120.0)
        rig.waiting = False
        # Placed within one sampling period of when it ended.
        assert not rig.run_for(3.0 - sample_period(3.0) - 0.01)
        assert rig.run_for(sample_period(3.0) + 0.2)


def test_time_outside_the_training_function_is_not_counted(rig: Rig) -> None:
    assert not rig.run_for(100.0)  # before run(): forming, standby
    with rig.live.training():
        assert not rig.run_for(2.0)
    assert not rig.run_for(100.0)  # the reset path
    with rig.live.training():  # the clock starts with the training function
        assert not rig.run_for(2.9)


def test_a_frozen_process_is_not_taken_for_a_hang(rig: Rig) -> None:
    with rig.live.training():
        assert not rig.run_for(1.0)
        rig.clock.advance(30.0)  # SIGSTOP: the monitor itself did not run
        v = rig.det.poll()
        assert not v.hung and rig.det.freezes == 1
        assert not rig.run_for(2.9)  # a fresh timeout after the freeze
        assert rig.run_for(0.2)


def test_off_when_the_timeout_is_zero_and_the_setting_is_read_each_time(rig: Rig) -> None:
    rig.timeout = 0.0
    with rig.live.training():
        assert not rig.run_for(500.0)
        rig.timeout = 3.0
        assert rig.run_for(3.1)


@pytest.mark.parametrize("timeout", [3.0, 0.0])  # known with hang detection off too
def test_how_long_the_thread_has_waited_on_peers_without_a_break(rig: Rig,
                                                                 timeout: float) -> None:
    rig.timeout = timeout
    assert not rig.run_for(5.0)
    assert rig.det.waiting_on_peers_s() == 0.0  # not training
    with rig.live.training():
        assert not rig.run_for(2.0)
        assert rig.det.waiting_on_peers_s() == 0.0  # in its own code
        rig.waiting = True  # seen on the stack: only sampled with hang detection on
        assert not rig.run_for(30.0)
        if timeout:
            assert 29.0 <= rig.det.waiting_on_peers_s() <= 30.0  # from the poll that saw it
        else:
            assert rig.det.waiting_on_peers_s() == 0.0
        rig.waiting = False
        assert not rig.run_for(1.0)
        assert rig.det.waiting_on_peers_s() == 0.0  # the wait ended: the next one starts at 0
        with rig.live.collective():
            assert not rig.run_for(4.0)
            assert 3.0 <= rig.det.waiting_on_peers_s() <= 4.0
    assert not rig.run_for(1.0)
    assert rig.det.waiting_on_peers_s() == 0.0
    with rig.live.collective():  # the state sync of a reset, outside the training function
        assert not rig.run_for(4.0)
        assert 3.0 <= rig.det.waiting_on_peers_s() <= 4.0


def test_the_monitor_tells_how_long_the_thread_waits_on_peers() -> None:
    live = TrainingLiveness()
    told: list[float] = []
    twice = threading.Event()

    def on_waiting(waited: float) -> None:
        told.append(waited)
        if len(told) >= 2:
            twice.set()

    mon = HangMonitor(HangDetector(live, lambda: 0.5), lambda r: None, on_waiting=on_waiting)
    with live.training(), live.collective():
        mon.start()
        try:
            assert twice.wait(30), told
        finally:
            mon.stop()
    assert told[1] > told[0] >= 0.0


def test_the_first_step_has_its_own_allowance_each_time_training_starts(rig: Rig) -> None:
    rig.first_step = 20.0
    for _entry in range(2):  # the job's start, then a reset: the function is entered again
        with rig.live.training():
            assert not rig.run_for(19.9)  # compiling, warming up: not a hang
            rig.live.stepped()
            assert not rig.run_for(2.9)  # after the first step, hang_timeout_s again
            assert rig.run_for(0.2)
            v = rig.det.poll()
            assert v.hung and not v.first_step and v.timeout_s == 3.0


def test_a_first_step_stuck_past_its_allowance_is_a_hang_and_says_so(rig: Rig) -> None:
    rig.first_step = 20.0
    with rig.live.training():
        rig.waiting = True  # the first step's collective (DDP's broadcast, say)
        assert not rig.run_for(50.0)
        rig.waiting = False
        assert not rig.run_for(19.0)  # still its first step: the allowance holds
        assert rig.run_for(1.5)
        v = rig.det.poll()
        assert v.hung and v.first_step and v.timeout_s == 20.0
        report = rig.det.report(v)
    assert report.first_step and "hang_first_step_s=20" in report.summary()
    assert "before its first step" in report.summary()


@pytest.mark.parametrize("first_step", [0.0, 1.0])
def test_a_first_step_allowance_under_hang_timeout_changes_nothing(rig: Rig,
                                                                   first_step: float) -> None:
    rig.first_step = first_step  # 0 (an older run's record), or shorter than the timeout
    with rig.live.training():
        assert not rig.run_for(2.9)
        assert rig.run_for(0.2)
        v = rig.det.poll()
        assert v.timeout_s == 3.0 and not v.first_step  # hang_timeout_s is what applied
        assert "(hang_timeout_s=3)" in rig.det.report(v).summary()


def test_the_first_step_allowance_is_read_each_time(rig: Rig) -> None:
    with rig.live.training():
        assert not rig.run_for(2.0)
        rig.first_step = 10.0  # peer-elastic set hang_first_step_s=10 meanwhile
        assert not rig.run_for(7.9)
        assert rig.run_for(0.2)


def test_exempt_work_is_not_counted_and_the_clock_restarts_at_its_end(rig: Rig) -> None:
    with rig.live.training():
        rig.live.stepped()
        assert not rig.run_for(2.0)
        with rig.live.exempt():  # rank 0's snapshot staging, a user's checkpoint
            assert not rig.run_for(60.0)
            with rig.live.exempt():  # reentrant
                assert not rig.run_for(5.0)
            assert not rig.run_for(5.0)  # still inside the outer one
        assert rig.det.waiting_on_peers_s() == 0.0  # exempt work is no wait on peers
        assert not rig.run_for(2.9)  # a fresh clock from its end
        assert rig.run_for(0.2)


def test_sample_period_is_a_tenth_of_the_timeout_at_most_a_second() -> None:
    assert sample_period(3.0) == pytest.approx(0.3)
    assert sample_period(30.0) == 1.0
    assert sample_period(0.1) == 0.05


def _blocked_in(path: str, started: threading.Event, release: threading.Event) -> threading.Thread:
    """A thread blocked inside a function whose code claims to live at ``path``."""
    ns: dict = {}
    exec(compile("def wait(started, release):\n    started.set()\n    release.wait(30)\n",
                 path, "exec"), ns)
    t = threading.Thread(target=ns["wait"], args=(started, release), daemon=True)
    t.start()
    assert started.wait(10)
    return t


@pytest.mark.parametrize("path, waiting", [
    ("/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", True),
    ("/venv/lib/python3.12/site-packages/torch/nn/parallel/distributed.py", True),
    # DistributedOptimizer's all-reduce, issued without torch's wrapper (the file itself, as
    # installed here: a peer blocked in it waits on a hung one, it is not hung itself).
    (direct_all_reduce.__file__, True),
    # A state sync waits on its buckets' and layout check's works in these modules themselves.
    (collectives.__file__, True),
    (layout_check.__file__, True),
    ("/venv/lib/python3.12/site-packages/peer_elastic/optim.py", False),
    ("/venv/lib/python3.12/site-packages/torch/utils/data/dataloader.py", False),
    ("/home/me/train.py", False),
])
def test_stack_probe_recognises_collectives_on_a_real_thread(path: str, waiting: bool) -> None:
    started, release = threading.Event(), threading.Event()
    t = _blocked_in(path, started, release)
    try:
        assert thread_waits_on_peers(t.ident) is waiting
    finally:
        release.set()
        t.join(10)
    assert not thread_waits_on_peers(t.ident)  # gone: no frames


def test_stack_probe_sees_backward_through_the_autograd_engine() -> None:
    path = "/venv/lib/python3.12/site-packages/torch/autograd/graph.py"
    ns: dict = {}
    exec(compile("def _engine_run_backward(f):\n    return f()\n"
                 "def other(f):\n    return f()\n", path, "exec"), ns)
    seen = {}
    ns["_engine_run_backward"](lambda: seen.setdefault("bw", frame_waits_on_peers(
        sys._getframe())))
    ns["other"](lambda: seen.setdefault("other", frame_waits_on_peers(sys._getframe())))
    assert seen == {"bw": True, "other": False}


def test_reading_another_threads_frame_runs_no_collection_and_restores_the_gc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # CPython before 3.11.9 could deadlock when a collection started inside
    # sys._current_frames (gh-106883): a peer froze whole. Before 3.12 the call runs with
    # automatic collection off, and the collector's setting is as it was afterwards.
    import gc

    real = sys._current_frames
    seen = []
    monkeypatch.setattr(sys, "_current_frames", lambda: (seen.append(gc.isenabled()), real())[1])
    here = threading.get_ident()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            frame = current_frame_of(here)
            names = []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            assert "current_frame_of" in names  # this thread's stack, taken inside the call
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == ([False, False] if sys.version_info < (3, 12) else [True, False])


def test_response_dumps_every_stack_fences_then_exits_with_the_documented_code(
        tmp_path: Path) -> None:
    order: list[str] = []
    report = HangReport(3.2, 3.0, 1, "MainThread", ("train.py:10 in load",))
    with open(tmp_path / "err", "w+") as stream:  # faulthandler needs a real file
        respond_to_hang(report, lambda r: order.append(f"fence {r.thread_name}"),
                        stream=stream, exit=lambda code: order.append(f"exit {code}"),
                        budget_s=None)
        stream.seek(0)
        text = stream.read()
    assert order == ["fence MainThread", f"exit {EXIT_HUNG}"]
    assert EXIT_HUNG == 5
    assert "hung: training thread 'MainThread' made no progress for 3.2 s" in text
    assert "Current thread" in text or "Thread 0x" in text  # faulthandler's format
    assert "test_response_dumps_every_stack" in text  # this very stack is in the dump


def test_monitor_fires_once_with_where_the_thread_is_stuck() -> None:
    live = TrainingLiveness()
    fired: list[HangReport] = []
    done = threading.Event()
    det = HangDetector(live, lambda: 0.3)
    mon = HangMonitor(det, lambda r: (fired.append(r), done.set()))
    release = threading.Event()

    def stuck_data_loader() -> None:
        with live.training():
            release.wait(30)

    t = threading.Thread(target=stuck_data_loader, name="trainer", daemon=True)
    t.start()
    mon.start()
    try:
        assert done.wait(20)
    finally:
        release.set()
        mon.stop()
        t.join(10)
    assert len(fired) == 1
    r = fired[0]
    assert r.thread_name == "trainer" and r.idle_s >= 0.3
    assert "stuck_data_loader" in r.summary()


# -- settings, records, roster ------------------------------------------------------------


def test_hang_timeout_is_a_job_setting_from_the_environment() -> None:
    assert JobSettings().resolved().hang_timeout_s == 30.0
    s = JobSettings.from_env({"PEER_ELASTIC_HANG_TIMEOUT": "0"})
    assert s.resolved().hang_timeout_s == 0.0  # off
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="hang_timeout_s"):
            JobSettings.from_env({"PEER_ELASTIC_HANG_TIMEOUT": bad}).resolved()
    job = JobSettings(hang_timeout_s=30.0).resolved()
    with pytest.raises(ConfigError, match=r"hang_timeout_s: this peer has 5\.0"):
        JobSettings(hang_timeout_s=5.0).check_against(job, "j")
    JobSettings().check_against(job, "j")  # unset: adopted


def test_fence_records_are_validated() -> None:
    rec = FenceRecord(member_id="h-1-abc", cause=FenceCause.FENCE_CAUSE_HUNG, detail="x")
    assert decode(FenceRecord, encode(rec)).cause == FenceCause.FENCE_CAUSE_HUNG
    for bad in (FenceRecord(member_id="a/b", cause=FenceCause.FENCE_CAUSE_HUNG),
                FenceRecord(member_id="h-1-abc"),  # no cause
                FenceRecord(member_id="h-1-abc", cause=77)):  # a cause from the future
        with pytest.raises(RecordError):
            decode(FenceRecord, encode(bad))


def test_the_next_generation_names_a_fenced_member_hung_and_never_readmits_it() -> None:
    from peer_elastic.etcd.roster import GenerationPlan, plan_next_generation

    fence = FenceRecord(member_id="m2", cause=FenceCause.FENCE_CAUSE_HUNG)
    roster = ["m1", "m2", "m3"]
    snap = views.snap(["m1", "m3"], (4, roster), fenced={"m2": fence})
    plan = plan_next_generation(snap, JobSettings().resolved(), {}, now=100.0)
    assert isinstance(plan, GenerationPlan)
    assert plan.roster == ("m1", "m3") and plan.removed == ("m2",)
    assert "hung" in plan.reason and "m2" in plan.reason and "left" not in plan.reason
    assert plan.causes == (GenerationCause.GENERATION_CAUSE_HUNG,)
    # A fenced member whose key survived (etcd trouble during the fence) is never eligible.
    with_key = views.snap(roster, (4, roster), fenced={"m2": fence})
    assert [m.id for m in with_key.eligible()] == ["m1", "m3"]


def test_hang_timeout_has_a_lower_bound_and_first_step_a_default() -> None:
    for ok in ("0", "1", "1.5", "30"):
        JobSettings.from_env({"PEER_ELASTIC_HANG_TIMEOUT": ok}).resolved()
    for bad in ("0.05", "0.999", "-0.5"):
        with pytest.raises(ConfigError, match=r"hang_timeout_s must be 0 \(off\) or at least "
                           r"1 s, got .*fenced.*blacklist"):
            JobSettings.from_env({"PEER_ELASTIC_HANG_TIMEOUT": bad}).resolved()
    cfg = JobSettings().resolved()
    assert cfg.hang_first_step_s == 600.0
    assert JobSettings.from_env({"PEER_ELASTIC_HANG_FIRST_STEP": "0"}).resolved() \
        .hang_first_step_s == 0.0  # no allowance of its own: hang_timeout_s
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="hang_first_step_s"):
            JobSettings.from_env({"PEER_ELASTIC_HANG_FIRST_STEP": bad}).resolved()


@pytest.mark.slow
def test_set_refuses_a_hang_timeout_under_the_bound_on_a_running_job(
        etcd: str, unique_job: str) -> None:
    from peer_elastic.etcd.admin import current_run
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator

    client = EtcdClient(etcd, retry_budget_s=10)
    c = Coordinator(client, unique_job, JobSettings(start_settle_s=0.1)).start()
    try:
        c.wait_generation(0, timeout=30)

        def cli_set(*assignments: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "peer_elastic.cli", "set", "--etcd",
                                   etcd, "--job", unique_job, *assignments],
                                  capture_output=True, text=True, timeout=120)

        refused = cli_set("hang_timeout_s=0.05")
        assert refused.returncode != 0, refused.stdout
        assert "hang_timeout_s must be 0 (off) or at least 1 s, got 0.05" in refused.stderr
        assert "blacklist" in refused.stderr
        run, _ = current_run(client, unique_job)
        assert run.config.hang_timeout_s == 30.0 and "hang_timeout_s" not in run.overridden
        # Both hang settings change at run time (the detector reads them at every look).
        done = cli_set("hang_timeout_s=1", "hang_first_step_s=120")
        assert done.returncode == 0, done.stderr
        run, _ = current_run(client, unique_job)
        assert run.config.hang_timeout_s == 1.0 and run.config.hang_first_step_s == 120.0
    finally:
        c.close(leave=True)
        client.close()


# -- the real thing -----------------------------------------------------------------------

HANG_TIMEOUT = 3.0
SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_HANG_TIMEOUT": HANG_TIMEOUT,
    # Far beyond what the tests wait: only liveness can end the wait on a hung peer.
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 300,
    "PEER_ELASTIC_MIN_NP": 1,
    "WORKER_SAMPLES": 960,
    "WORKER_STEP_S": 0.03,
    "WORKER_EPOCHS": 2,
}


cluster = cluster_fixture(SETTINGS)


def events_of(cluster: Cluster) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "events", "--etcd",
                        cluster.env["PEER_ELASTIC_ETCD"], "--job", cluster.env["PEER_ELASTIC_JOB"],
                        "--json"], capture_output=True, text=True, timeout=60)
    return [json.loads(line) for line in r.stdout.splitlines()]


def first_to_print(peers: list[PeerProc], prefix: str, timeout: float) -> PeerProc:
    """The peer that printed a line starting with ``prefix`` (bounded wait on all)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in peers:
            try:
                p.wait_line(prefix, timeout=0.1)
                return p
            except AssertionError:
                continue
    raise AssertionError(f"no peer printed {prefix!r}:\n" + "\n".join(p.output() for p in peers))


def line_index(p: PeerProc, prefix: str) -> int:
    with p.cond:
        return next(i for i, line in enumerate(p.lines) if line.startswith(prefix))


@pytest.mark.slow
def test_a_hung_training_thread_is_fenced_and_the_rest_finish_exactly_once(
        cluster: Cluster, tmp_path: Path) -> None:
    # Every peer carries the knob; the one that is rank 0 (the leader, the oldest) at epoch
    # 0 batch 30 blocks there for good, its process and coordination thread alive.
    peers = cluster.start(3, WORKER_HANG_AT="0:30:0", WORKER_HANG_FLAG=tmp_path / "hung")
    for p in peers:
        p.wait_line("GEN", timeout=90)
    hung = first_to_print(peers, "HANGING", timeout=120)
    t_hang = time.monotonic()
    others = [p for p in peers if p is not hung]
    seen = {p.name: len(p.lines) for p in others}
    # The others train again: a new generation, then a step in it.
    for p in others:
        p.wait_line("GEN", after=seen[p.name], timeout=60)
    p = others[0]
    p.wait_line("STEP", after=seen[p.name], timeout=60)
    took = time.monotonic() - t_hang
    print(f"others stepped again {took:.2f} s after the hang (hang_timeout_s={HANG_TIMEOUT})")
    assert took < HANG_TIMEOUT + 10, took
    # The hung peer dumped its stacks (the blocked frame among them) and exited 5.
    assert hung.wait(60) == EXIT_HUNG, hung.output()
    with hung.cond:
        out = "\n".join(hung.lines)
    assert "peer-elastic: hung: training thread" in out
    assert "(most recent call first)" in out and "hang_forever" in out, out
    for q in others:
        assert q.wait(240) == 0, q.output()
        assert "peer-elastic: hung" not in q.output()  # waiting on it was not a hang
    found = results(peers)
    assert len(found) == 1 and found[0]["exact"] and found[0]["identical"], found
    assert found[0]["world"] == 2
    # Never rejoined: no GEN after its HANGING line.
    with hung.cond:
        after = hung.lines[line_index(hung, "HANGING"):]
    assert not [line for line in after if line.startswith("GEN")]
    events = events_of(cluster)
    hung_events = [e for e in events if e["kind"] == "hung"]
    assert len(hung_events) == 1 and "made no progress" in hung_events[0]["detail"], events
    gens = [e["detail"] for e in events if e["kind"] == "generation"]
    assert any("hung" in d and hung_events[0]["member"] in d for d in gens), gens


@pytest.mark.slow
def test_a_long_first_step_is_not_a_hang_and_a_hang_after_it_still_is(
        cluster: Cluster, tmp_path: Path) -> None:
    # Each time the training function starts, every peer spends twice hang_timeout_s before
    # its first batch (compiling, a data loader warming up), within hang_first_step_s. Then
    # one peer's training thread blocks for good at batch 30: that is still a hang. The
    # survivor starts the training function again after the reset, warms up again, and is
    # not fenced for it.
    warmup = 2 * HANG_TIMEOUT
    peers = cluster.start(2, PEER_ELASTIC_HANG_FIRST_STEP=30, WORKER_FIRST_STEP_S=warmup,
                          WORKER_HANG_AT="0:30", WORKER_HANG_FLAG=tmp_path / "hung")
    hung = first_to_print(peers, "HANGING", timeout=180)
    (other,) = [p for p in peers if p is not hung]
    assert hung.wait(120) == EXIT_HUNG, hung.output()
    assert other.wait(240) == 0, other.output()
    assert "peer-elastic: hung" not in other.output()
    with hung.cond:
        out = "\n".join(hung.lines)
    assert "made no progress" in out and f"(hang_timeout_s={HANG_TIMEOUT:g})" in out, out
    with other.cond:
        warmups = [line for line in other.lines if line.startswith("WARMUP")]
    assert len(warmups) >= 2, other.output()  # the job's start and the reset after the hang
    found = results(peers)
    assert len(found) == 1 and found[0]["exact"] and found[0]["identical"], found
    assert found[0]["world"] == 1
    hung_events = [e for e in events_of(cluster) if e["kind"] == "hung"]
    assert len(hung_events) == 1 and "first step" not in hung_events[0]["detail"], hung_events


@pytest.mark.slow
def test_a_slow_step_under_the_timeout_is_not_a_hang(cluster: Cluster) -> None:
    # Batch 20 of each epoch takes 2 s more on rank 1 (an evaluation, a slow batch), against
    # a 3 s timeout; the others wait for it in the gradient all-reduce meanwhile.
    timeout = HANG_TIMEOUT
    slow = timeout - 1.0
    peers = cluster.start(3, WORKER_SLOW_AT=f"0:20:{slow}:1")
    for p in peers:
        assert p.wait(240) == 0, p.output()
    assert any(line.startswith("SLOW") for p in peers for line in p.lines)
    for p in peers:
        assert "peer-elastic: hung" not in "\n".join(p.lines), p.output()
    found = results(peers)
    assert len(found) == 1 and found[0]["exact"] and found[0]["identical"], found
    assert not [e for e in events_of(cluster) if e["kind"] == "hung"]


@pytest.mark.slow
def test_peers_blocked_in_a_collective_on_a_frozen_peer_are_not_hung(cluster: Cluster) -> None:
    # One peer is frozen (SIGSTOP) for 3x hang_timeout, within its lease (TTL raised), so
    # nobody drops it: the others wait for it in a collective all that time. Neither they
    # (they wait on a peer) nor it (its whole process did not run) is a hang; the job
    # finishes with all three, exactly once.
    peers = cluster.start(3, PEER_ELASTIC_LEASE_TTL=30, PEER_ELASTIC_RUN_TTL=60)
    for p in peers:
        p.wait_line("GEN", timeout=90)
    a, b, c = peers
    b.wait_line("STEP", after=len(b.lines), timeout=60)
    c.signal(signal.SIGSTOP)
    try:
        # Bounded by the test, not a synchronisation: the freeze is the thing tested.
        time.sleep(3 * HANG_TIMEOUT)
        assert a.proc.poll() is None and b.proc.poll() is None
    finally:
        c.signal(signal.SIGCONT)
    for p in peers:
        assert p.wait(240) == 0, p.output()
        assert "peer-elastic: hung" not in "\n".join(p.lines), p.output()
    found = results(peers)
    assert len(found) == 1 and found[0]["exact"] and found[0]["identical"], found
    assert found[0]["world"] == 3  # nobody was dropped
    assert not [e for e in events_of(cluster) if e["kind"] == "hung"]


def test_fence_takes_the_member_out_at_once_for_good_and_says_why(
        etcd: str, unique_job: str) -> None:
    from peer_elastic.etcd.admin import update_config
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.etcd.fence import fence_member

    settings = JobSettings(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3,
                           join_timeout_s=1.0)
    clients = [EtcdClient(etcd, retry_budget_s=10) for _ in range(3)]
    coords = []
    try:
        for c in clients:
            coords.append(Coordinator(c, unique_job, settings).start())
        ids = {c.member_id for c in coords}
        snap = coords[1].view.wait_for(
            lambda s: s.generation is not None and set(s.generation.roster) == ids, 15)
        assert snap is not None
        victim = coords[0]  # the oldest: the leader, as in the worst case
        gone = victim.member_id
        t0 = time.monotonic()
        out = fence_member(victim, FenceCause.FENCE_CAUSE_HUNG, "stuck at train.py:10",
                           generation=snap.generation.number)
        assert out.recorded and out.revoked, out
        after = coords[1].view.wait_for(
            lambda s: s.generation is not None and gone not in s.generation.roster, 10)
        took = time.monotonic() - t0
        assert after is not None
        # At once (settle_s), not after join_timeout_s or the lease TTL.
        assert took < 1.0 + settings.join_timeout_s, took
        assert len(after.generation.roster) == 2
        assert "hung" in after.generation.reason and gone in after.generation.reason
        assert after.fenced[gone].detail == "stuck at train.py:10"
        assert gone not in after.members
        # It does not come back: its coordinator is closed and does not re-register.
        assert coords[1].view.wait_for(lambda s: len(s.members) > 2, 2.0) is None
        # hang_timeout_s can change while the job runs; every peer reads the new value.
        update_config(clients[1], unique_job, {"hang_timeout_s": 0})
        assert coords[2].view.wait_for(lambda s: s.run.config.hang_timeout_s == 0, 10)
    finally:
        for c in coords:
            c.close()
        for c in clients:
            c.close()
