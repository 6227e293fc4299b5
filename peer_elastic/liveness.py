"""Training-thread liveness: a peer whose training thread hangs while its process lives.

Every proof of life the coordination layer gives (the lease, ``ready`` and ``alive`` acks)
comes from the coordination thread. A training thread stuck for good in its own code (a
data loader that never yields, a device call that never returns, a deadlock) leaves that
proof intact, and the other peers wait for it in their next collective forever (or until
the collective timeout, after which they re-form *with* it and wait again).

So the training thread is watched too:

* :class:`TrainingLiveness` is written by the training thread at a few points that cost a
  clock read each: entering and leaving the user's training function, each step
  (``check_host_updates()``, also inside ``commit()``), and around peer-elastic's own
  collectives;
* :class:`HangDetector` decides, from that record, a clock and the training thread's Python
  stack, whether the thread is hung: it has been inside the training function, outside any
  collective, for ``hang_timeout_s`` since it last made progress. Progress is a step, the
  start of the training function, the end of a wait on other peers and the end of exempt
  work. Until its first step after the training function starts (the job's start, every
  reset: compilation, the first forward, a data loader's warm-up, DDP's first buckets) the
  allowance is ``hang_first_step_s`` instead, when that is longer. A wait on other
  peers is a marked collective of our own, or a stack with a frame under
  ``torch/distributed/``, DDP, or the autograd engine's backward (where DDP's all-reduces
  run); the stack is sampled every ``min(1 s, hang_timeout_s / 10)``. Time spent outside the
  training function (forming a group, waiting as a standby, syncing state, reset
  callbacks) never counts, nor does time the whole process did not run (SIGSTOP, swapping):
  the monitor notices it woke up late and starts the clock afresh. Nor does work marked
  exempt (:meth:`TrainingLiveness.exempt`): rank 0's staging copy of a durable snapshot,
  and whatever the user marks with ``Peer.hang_exempt()`` (a checkpoint of their own);
* :class:`HangMonitor` is the thread that polls the detector and, on a hang, calls
  :func:`respond_to_hang`: dump every thread's stack (faulthandler) to stderr, fence the
  member (:func:`peer_elastic.etcd.fence.fence_member`: event, fence record, member key and
  lease gone, so the others drop it at once with the reason "hung"), and exit the process
  with :data:`EXIT_HUNG`, so that systemd or a scheduler restarts it as a new member.

The detector also knows how long the thread has waited on its peers without a break
(:meth:`HangDetector.waiting_on_peers_s`; with hang detection off, only in peer-elastic's
own collectives, since the stack is then never sampled); the monitor tells
the peer's probes of its group, which probe the group's members when a wait grows long (a
peer cut off from the others but not from etcd keeps its lease: see
``peer_elastic.torch.reachability.Reachability.waited_on_peers``).

Why a peer waiting on the hung one is not declared hung itself: it is in a collective (the
hung peer is the one in its own code), and a collective restarts its clock. Why a slow
step is not: the clock only runs out after ``hang_timeout_s`` of user code with no step and
no collective in between; a step shorter than that can never do it.

Nothing here imports torch: the detector is tested with a fake clock.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from types import FrameType
from typing import IO, Any

from peer_elastic.process import threads
from peer_elastic.straggler import waits

log = logging.getLogger(__name__)

#: Exit status of a peer that fenced itself because its training thread hung. Not 4
#: (EXIT_JOB_FAILED): the job goes on, and a restarted peer joins it as a new member.
EXIT_HUNG = 5

#: How late the monitor may wake before it concludes that the process did not run (stopped,
#: swapped out, starved) and restarts the clock instead of blaming the training thread.
FREEZE_SLACK_S = 1.0

#: Longest the response to a hang may take (stack dump, etcd writes): past it, faulthandler's
#: own thread dumps the stacks again and ends the process (exit status 1).
RESPONSE_BUDGET_S = 60.0

# Frames that mean "waiting on other peers". DDP's forward broadcasts buffers, and its
# all-reduces run inside backward, called from the autograd engine. DistributedOptimizer's
# all-reduce and the commit's exchange skip torch's Python wrapper
# (peer_elastic/torch/transport/direct_all_reduce.py), so no frame of theirs lies under
# torch/distributed/: that module only issues and waits on collectives, and its frames count
# as such. So do the state sync's (peer_elastic/torch/transport/collectives.py and
# layout_check.py: they wait on their buckets' and layout check's works themselves, with no
# torch frame under them).
_PEER_WAIT_PATHS = ("/torch/distributed/", "/torch/nn/parallel/distributed.py",
                    "/peer_elastic/torch/transport/direct_all_reduce.py",
                    "/peer_elastic/torch/transport/collectives.py",
                    "/peer_elastic/torch/transport/layout_check.py")
_AUTOGRAD_PATH = "/torch/autograd/"
_BACKWARD_NAMES = frozenset({"backward", "grad", "_engine_run_backward", "run_backward"})


class Activity(Enum):
    """Where the training thread is, as far as liveness is concerned."""

    OUTSIDE = "outside"  # not in the training function: reset path, standby, before or after
    TRAINING = "training"  # inside the user's training function


@dataclass(frozen=True)
class TrainingRecord:
    """One consistent reading of :class:`TrainingLiveness`."""

    activity: Activity
    thread_id: int | None
    progress_at: float  # clock time of the last step, training start, end of a marked span
    in_collective: bool  # inside a collective that marked itself
    steps: int
    exempt: bool = False  # inside work marked as no hang (a snapshot's staging copy)
    first_step: bool = False  # in the training function, before its first step


class _Span:
    """A reusable, reentrant context manager calling ``enter`` and ``leave``: how the
    training thread marks a collective or exempt work at the cost of a lock each way."""

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None]) -> None:
        self._enter, self._leave = enter, leave

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        self._leave()


class TrainingLiveness:
    """What the training thread is doing, written by it, read by the monitor."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._activity = Activity.OUTSIDE
        self._thread: int | None = None
        self._progress_at = clock()
        self._depth = 0
        self._exempt_depth = 0
        self._first_step = False
        self._steps = 0
        self._collective = _Span(self._enter_collective, self._leave_collective)
        self._exempt = _Span(self._enter_exempt, self._leave_exempt)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the call of the user's training function, on the training thread."""
        with self._lock:
            self._activity, self._thread = Activity.TRAINING, threading.get_ident()
            self._progress_at, self._depth, self._exempt_depth = self._clock(), 0, 0
            self._first_step = True  # entered anew (the job's start, a reset): warm-up
        try:
            yield
        finally:
            with self._lock:
                self._activity, self._thread = Activity.OUTSIDE, None
                self._progress_at, self._depth, self._exempt_depth = self._clock(), 0, 0
                self._first_step = False

    def stepped(self) -> None:
        """The training thread reached a step (``check_host_updates()``)."""
        with self._lock:
            self._progress_at = self._clock()
            self._steps += 1
            self._first_step = False

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """A context manager marking a wait on other peers the stack may not show."""
        return self._collective

    def exempt(self) -> contextlib.AbstractContextManager[None]:
        """A context manager marking work of the training thread that is not a hang however
        long it takes (a durable snapshot's staging copy, a checkpoint the user saves). Its
        time never counts, and its end counts as progress. Not a wait on other peers."""
        return self._exempt

    # Each span is also timed on the marking thread's tally (peer_elastic.straggler.waits):
    # the straggler score counts a marked wait as waiting, exempt work as neither.

    def _enter_collective(self) -> None:
        waits.tally().enter_wait()
        with self._lock:
            self._depth += 1

    def _leave_collective(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            self._progress_at = self._clock()  # it waited for the others: that was progress
        waits.tally().leave_wait()

    def _enter_exempt(self) -> None:
        waits.tally().enter_exempt()
        with self._lock:
            self._exempt_depth += 1

    def _leave_exempt(self) -> None:
        with self._lock:
            self._exempt_depth = max(0, self._exempt_depth - 1)
            self._progress_at = self._clock()  # the clock runs from the end of exempt work
        waits.tally().leave_exempt()

    def read(self) -> TrainingRecord:
        with self._lock:
            return TrainingRecord(self._activity, self._thread, self._progress_at,
                                  self._depth > 0, self._steps, self._exempt_depth > 0,
                                  self._first_step)


def frame_waits_on_peers(frame: FrameType | None) -> bool:
    """True when a Python stack (innermost ``frame``) is inside a collective or backward."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if any(p in path for p in _PEER_WAIT_PATHS):
            return True
        if _AUTOGRAD_PATH in path and code.co_name in _BACKWARD_NAMES:
            return True
        frame = frame.f_back
    return False


def current_frame_of(thread_id: int) -> FrameType | None:
    """Another thread's innermost frame (``sys._current_frames``), without CPython 3.11's
    deadlock: before 3.11.9 a garbage collection started inside that call (it allocates)
    could wait for the GIL while holding the runtime's thread-list lock, which a thread
    holding the GIL needed to start or end a thread (cpython gh-106883; 3.12 collects
    only between bytecodes). The whole process froze, lease keep-alives included. Seen
    here: the hang monitor in this call in a peer that fell silent in a schedule soak.
    The fix CPython backported is ours too: no automatic collection during the call."""
    if sys.version_info >= (3, 12):
        return sys._current_frames().get(thread_id)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames().get(thread_id)
    finally:
        if was_enabled:
            gc.enable()


def thread_waits_on_peers(thread_id: int) -> bool:
    """:func:`frame_waits_on_peers` for another thread's current stack."""
    return frame_waits_on_peers(current_frame_of(thread_id))


@dataclass(frozen=True)
class Verdict:
    """One look at the training thread."""

    hung: bool
    idle_s: float  # time in its own code since it last made progress (0 when not counted)
    timeout_s: float  # the allowance that applied: hang_timeout_s, or the first step's
    look_again_at: float  # clock time of the next look
    first_step: bool = False  # the thread had not reached its first step since it started


@dataclass(frozen=True)
class HangReport:
    """What a hung peer says about itself (log, stderr, event log, fence record)."""

    idle_s: float
    timeout_s: float
    thread_id: int
    thread_name: str
    where: tuple[str, ...]  # innermost frames first, "file:line in function"
    first_step: bool = False  # stuck before the first step since the training function started

    def summary(self) -> str:
        at = " <- ".join(self.where) if self.where else "unknown"
        allowance = (f"before its first step since the training function started "
                     f"(hang_first_step_s={self.timeout_s:g})" if self.first_step
                     else f"(hang_timeout_s={self.timeout_s:g})")
        return (f"training thread {self.thread_name!r} made no progress for {self.idle_s:.1f} s "
                f"in its own code, outside any collective {allowance}; at {at}")


def sample_period(timeout_s: float) -> float:
    """How often the stack is looked at: often enough that a collective's end is placed
    within a tenth of the timeout, never more than once a second."""
    return min(1.0, max(0.05, timeout_s / 10))


class HangDetector:
    """Decides whether the training thread is hung; the clock and the stack probe are
    injected, so it is tested without threads or torch."""

    def __init__(
        self,
        liveness: TrainingLiveness,
        timeout_s: Callable[[], float],
        *,
        first_step_s: Callable[[], float] = lambda: 0.0,
        waits_on_peers: Callable[[int], bool] = thread_waits_on_peers,
        clock: Callable[[], float] = time.monotonic,
        freeze_slack_s: float = FREEZE_SLACK_S,
    ) -> None:
        self._liveness = liveness
        self._timeout_s = timeout_s
        self._first_step_s = first_step_s
        self._waits_on_peers = waits_on_peers
        self._clock = clock
        self._freeze_slack_s = freeze_slack_s
        # Last time the thread was seen waiting on peers, or the process resumed from a
        # freeze: the clock runs from the later of this and the recorded progress.
        self._credit_at = -math.inf
        self._planned_at: float | None = None
        self._waiting_since: float | None = None  # first poll of the current wait on peers
        self.freezes = 0

    def waiting_on_peers_s(self) -> float:
        """How long the training thread has been waiting on other peers without a break,
        as of the last poll (0 when it is not). With hang detection off the stack is not
        sampled, so only peer-elastic's own (marked) collectives count then."""
        since = self._waiting_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def poll(self) -> Verdict:
        now = self._clock()
        if self._planned_at is not None and now - self._planned_at > self._freeze_slack_s:
            # We woke up much later than planned: the process (or this thread) did not run.
            # The training thread cannot be blamed for that time.
            self.freezes += 1
            self._credit_at = now
            log.info("hang monitor woke %.1f s late: not counting that time",
                     now - self._planned_at)
        verdict = self._judge(now)
        self._planned_at = verdict.look_again_at
        return verdict

    def _judge(self, now: float) -> Verdict:
        try:
            timeout = float(self._timeout_s())
        except Exception:  # settings unreadable (closing): look again later
            timeout = 0.0
        on = timeout > 0 and math.isfinite(timeout)
        rec = self._liveness.read()
        training = rec.activity is Activity.TRAINING and rec.thread_id is not None
        # Off, the stack is never sampled: only peer-elastic's own collectives count. They
        # count outside the training function too (the state sync of a reset).
        waiting = rec.in_collective or (training and on
                                        and self._waits_on_peers(rec.thread_id))
        if not waiting:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now
        if not on:
            return Verdict(False, 0.0, 0.0, now + 1.0)  # off; the setting is read each time
        period = sample_period(timeout)
        if not training:
            return Verdict(False, 0.0, timeout, now + period)
        if waiting or rec.exempt:
            # Waiting on others is not this peer's hang; exempt work is not a hang either.
            self._credit_at = now
            return Verdict(False, 0.0, timeout, now + period)
        # Before its first step the longer allowance applies; the report names the one
        # that did (an allowance no longer than hang_timeout_s changes nothing).
        allowance = self._first_step_allowance() if rec.first_step else 0.0
        first = allowance > timeout
        if first:
            timeout = allowance
        idle = now - max(rec.progress_at, self._credit_at)
        if idle >= timeout:
            return Verdict(True, idle, timeout, now, first)
        return Verdict(False, idle, timeout, now + min(period, timeout - idle), first)

    def _first_step_allowance(self) -> float:
        """hang_first_step_s; 0 (no allowance of its own) when unreadable or not finite."""
        try:
            allowance = float(self._first_step_s())
        except Exception:  # settings unreadable (closing): hang_timeout_s alone applies
            return 0.0
        return allowance if math.isfinite(allowance) else 0.0

    def report(self, verdict: Verdict) -> HangReport:
        """Where the training thread is stuck, for the log and the event log."""
        rec = self._liveness.read()
        tid = rec.thread_id or 0
        name = next((t.name for t in threading.enumerate() if t.ident == tid), str(tid))
        frame = current_frame_of(tid)
        where: tuple[str, ...] = ()
        if frame is not None:
            stack = traceback.extract_stack(frame)[::-1][:4]
            where = tuple(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                          for f in stack)
        return HangReport(verdict.idle_s, verdict.timeout_s, tid, name, where,
                          verdict.first_step)


class HangMonitor:
    """The thread that polls a :class:`HangDetector` and acts once on a hang."""

    def __init__(self, detector: HangDetector, on_hung: Callable[[HangReport], None],
                 clock: Callable[[], float] = time.monotonic,
                 on_waiting: Callable[[float], None] | None = None) -> None:
        self._detector = detector
        self._on_hung = on_hung
        self._on_waiting = on_waiting  # told after each poll how long the thread has waited
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: HangReport | None = None

    def start(self) -> HangMonitor:
        if self._thread is None:
            self._thread = threads.start(self._monitor_loop, "hang-monitor")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _monitor_loop(self) -> None:
        while not self._stop.is_set():
            try:
                verdict = self._detector.poll()
                if verdict.hung:
                    self.fired = self._detector.report(verdict)
                    self._on_hung(self.fired)
                    return
                waited = self._detector.waiting_on_peers_s()
                if waited > 0 and self._on_waiting is not None:
                    self._on_waiting(waited)
            except Exception:  # a bug here must not kill training; keep watching
                log.exception("hang monitor failed; retrying")
                verdict = Verdict(False, 0.0, 0.0, self._clock() + 1.0)
            self._stop.wait(max(0.0, verdict.look_again_at - self._clock()))


def respond_to_hang(
    report: HangReport,
    fence: Callable[[HangReport], object],
    *,
    stream: IO[str] | None = None,
    exit: Callable[[int], Any] = os._exit,
    budget_s: float | None = RESPONSE_BUDGET_S,
) -> None:
    """What a hung peer does: stacks to ``stream`` (stderr), ``fence``, then ``exit``.

    ``os._exit``: the training thread cannot be unwound, and nothing of this process may
    run on (no ``finally`` that trains or leaves gracefully, no atexit that waits on it).
    """
    stream = stream if stream is not None else sys.stderr
    if budget_s is not None:
        # Should anything below block for good (etcd gone past its retry budget, a stderr
        # nobody reads), faulthandler's own C thread dumps the stacks and exits anyway.
        faulthandler.dump_traceback_later(budget_s, exit=True)
    summary = report.summary()
    log.error("hung: %s; dumping stacks, leaving the job and exiting %d", summary, EXIT_HUNG)
    try:
        print(f"peer-elastic: hung: {summary}. Stacks of all threads:", file=stream, flush=True)
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
    except Exception as exc:  # no usable stream: the event log still gets the summary
        log.error("could not dump the stacks: %s", exc)
    try:
        fence(report)
    except Exception:
        log.exception("fencing this hung peer failed; exiting anyway")
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    for h in logging.getLogger("peer_elastic").handlers:
        with contextlib.suppress(Exception):
            h.flush()
    if budget_s is not None:
        faulthandler.cancel_dump_traceback_later()
    print(f"peer-elastic: exiting {EXIT_HUNG} (hung training thread); restart to rejoin as "
          "a new member", file=stream, flush=True)
    exit(EXIT_HUNG)


class TrainingWatch:
    """Training-thread liveness for one :class:`~peer_elastic.elastic.Peer`: the hooks its
    training thread calls, and the monitor that fences the peer if the thread hangs."""

    def __init__(self, coordinator: Any, generation: Callable[[], int], *,
                 clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], Any] = os._exit,
                 on_waiting: Callable[[float], None] | None = None) -> None:
        self.liveness = TrainingLiveness(clock)
        self._coordinator = coordinator
        self._generation = generation
        self._exit = exit
        self.detector = HangDetector(
            self.liveness, lambda: float(coordinator.config.hang_timeout_s),
            first_step_s=lambda: float(coordinator.config.hang_first_step_s), clock=clock)
        # on_waiting: how long the training thread has waited on its peers, about every
        # second while it does (the group manager probes them when that grows long).
        self.monitor = HangMonitor(self.detector, self._respond, clock, on_waiting)

    def training(self) -> contextlib.AbstractContextManager[None]:
        return self.liveness.training()

    def stepped(self) -> None:
        self.liveness.stepped()

    def collective(self) -> contextlib.AbstractContextManager[None]:
        return self.liveness.collective()

    def exempt(self) -> contextlib.AbstractContextManager[None]:
        return self.liveness.exempt()

    def start(self) -> None:
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.stop()

    def _respond(self, report: HangReport) -> None:
        from peer_elastic.etcd.fence import fence_member
        from peer_elastic.records import FenceCause

        generation = self._generation()
        respond_to_hang(report, lambda r: fence_member(
            self._coordinator, FenceCause.FENCE_CAUSE_HUNG, r.summary(), generation),
            exit=self._exit)
