"""Seeded chaos for a real elastic job: a pure schedule generator and a runner that applies it.

The job is ``tests/helpers/elastic_worker.py`` (the exactly-once oracle) on ``max_np`` roster
peers plus one standby, over a 3-member etcd cluster (:class:`EtcdCluster`). The schedule is
a pure function of the seed (``random.Random(seed)``); the runner maps each event onto the
processes that exist when it is applied, waits for the job to make progress again after it
(bounded, tied to STEP/GEN lines, never a fixed sleep standing in for progress), and records
what it did. Every message carries ``CHAOS SEED <seed>`` so a failure can be replayed with
``PEER_ELASTIC_CHAOS_SEED=<seed>`` (the schedule is identical; which process an event hits
depends on the roles at that moment, which are usually but not always the same).

Event kinds:

* ``kill``        SIGKILL a peer (a crash). Its exit code is not checked.
* ``term``        SIGTERM a peer: a graceful leave; it must exit 0.
* ``add``         start a new peer (it joins the roster, or waits as the standby).
* ``stop``        SIGSTOP a peer for longer than the lease TTL, then SIGCONT: its lease is
                  gone, the others go on without it and it rejoins as a new member.
* ``etcd_member`` stop one member of the 3-member etcd cluster (SIGKILL when ``hard``,
                  else SIGTERM), keep it down ``hold_s``, restart it on its old data.
* ``etcd_all``    stop all 3 members (SIGKILL together when ``hard``; else SIGTERM, the
                  followers first, then the leader), keep them down ``hold_s``, restart.

The etcd here is 3.5.1, which can lose writes (leases included) applied just before a
SIGKILL (fixed in 3.5.3): after a ``hard`` etcd event some peers may find their lease gone
and rejoin as new members. That costs a reset and is tolerated; the graceful (SIGTERM) etcd
events keep every write. Of the first two events of each etcd kind, one is a SIGKILL and one
a SIGTERM; each event's description says which.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from peer_elastic.etcd_server import EtcdServer, EtcdStartError
from peer_elastic.testing import EtcdCluster
from tests.helpers.hosts import Host, Hosts, NetnsUnavailable
from tests.helpers.procs import (
    Cluster,
    PeerProc,
    assert_no_thread_of_ours_left,
    native_stacks,
)
from tests.helpers.worker_lines import callback_digests

SEED_ENV = "PEER_ELASTIC_CHAOS_SEED"
EVENTS_ENV = "PEER_ELASTIC_CHAOS_EVENTS"

KINDS = ("kill", "term", "add", "stop", "etcd_member", "etcd_all")
DISRUPTIONS = tuple(k for k in KINDS if k != "add")
DEPARTURES = ("kill", "term")  # the peer is gone for good: an `add` replaces it
# Mix of the disruptions beyond the required ones (the expensive ones are rarer).
FILL_WEIGHTS = {"kill": 4, "term": 3, "stop": 2, "etcd_member": 2, "etcd_all": 1}
ADD_PROBABILITY = 0.65  # after a departure, chance that the next event replaces the peer

# Job settings for the runner's peers (lease TTL 3 s: a `stop` lasts TTL + 1..3 s).
LEASE_TTL_S = 3.0
SETTINGS: dict[str, object] = {
    "PEER_ELASTIC_LEASE_TTL": LEASE_TTL_S,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    # A peer stopped inside a collective holds the others until this (or, with the
    # in-flight-collective abort, about TTL + join timeout): generous but bounded.
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 20,
    "PEER_ELASTIC_ELASTIC_TIMEOUT": 180,
    "PEER_ELASTIC_LOG_LEVEL": "INFO",  # "joined job ... as <id>" tells us a peer registered
    "OMP_NUM_THREADS": 1,
    # Short epochs (15 batches per rank at world 4), so events land on epoch ends too; a
    # step is mostly its sleep, so the pace is about the same on a faster machine.
    "WORKER_SAMPLES": 240,
    "WORKER_BATCH": 4,
    "WORKER_STEP_S": 0.05,
    "WORKER_COMMIT_EVERY": 2,
    # A peer that falls silent (no batch for 20 s: far past any stop or outage an event
    # makes) writes every thread's stack into its log, for the report of a failed run.
    "WORKER_STACKS_AFTER_S": 20,
}
# Training length: about 2.4-2.5 epochs of WORKER_SAMPLES pass per event (measured on 2
# busy cores, 30 and 200 events); the job must outlast the schedule, so BASE_EPOCHS and
# 5 * sqrt(events) more make the margin (~45% for 30 events, ~20% for 200), for a faster
# machine and for short schedules' variance. See training_epochs().
EPOCHS_PER_EVENT = 2.5
BASE_EPOCHS = 10

_JOINED = re.compile(r"joined job \S+ run \S+ as (\S+)")
_REJOINED = re.compile(r"re-registered as (\S+)")


def _numbers(line: str) -> tuple[int, int, int] | None:
    """The three integers after the tag of a GEN or STEP line; None for a truncated line."""
    parts = line.split()
    if len(parts) != 4:
        return None
    try:
        a, b, c = (int(x) for x in parts[1:])
    except ValueError:
        return None
    return a, b, c


# --- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One scheduled event. ``pick`` in [0, 1) selects the target among the candidates the
    runner finds at that moment (peers sorted by start order; etcd members by index)."""

    index: int
    kind: str
    pick: float = 0.0
    hold_s: float = 0.0  # stop: how long SIGSTOPped; etcd_*: how long down
    hard: bool = False  # etcd_*: SIGKILL (may lose 3.5.1's last writes) or graceful SIGTERM
    gap_s: float = 0.0  # extra pause after the job made progress again
    # kill: the next event follows after gap_s without waiting for the job to re-form, so it
    # lands in the middle of the reset (a rendezvous, the agreement, a sync)
    burst: bool = False

    def describe(self) -> str:
        return self._describe() + (", then at once" if self.burst else "")

    def _describe(self) -> str:
        extra = ""
        if self.kind == "stop":
            extra = f" for {self.hold_s:.1f}s"
        elif self.kind.startswith("etcd"):
            extra = f" {'SIGKILL' if self.hard else 'SIGTERM'}, down {self.hold_s:.1f}s"
        return f"#{self.index} {self.kind}{extra}"


def make_schedule(seed: int, n_events: int = 30, *, peers: int = 5, min_np: int = 2,
                  lease_ttl_s: float = LEASE_TTL_S, min_each: int = 2) -> list[Event]:
    """The seeded schedule: at least ``n_events`` events, every kind at least ``min_each``
    times, ending with ``peers`` peers running again.

    It models the number of running peers (start: ``peers``): a departure (kill, term) takes
    one away, ``add`` brings one back (never beyond ``peers``), and a ``stop`` takes one away
    while it lasts (the runner applies it blocking, so it is back before the next event).
    No departure or stop ever leaves fewer than ``min_np``: an ``add`` comes first.
    """
    if peers < min_np + 1:
        raise ValueError("need at least min_np + 1 peers to disturb any")
    rng = random.Random(seed)
    required = [k for k in DISRUPTIONS for _ in range(min_each)]
    n_disrupt = max(len(required), round(n_events * 0.62))
    kinds, weights = list(FILL_WEIGHTS), list(FILL_WEIGHTS.values())
    disruptions = required + rng.choices(kinds, weights, k=n_disrupt - len(required))
    rng.shuffle(disruptions)
    out: list[Event] = []
    live = peers

    def emit(kind: str) -> None:
        pick = rng.random()
        hold, hard = 0.0, rng.random() < 0.5
        # Of the first two etcd events of a kind, one is a SIGKILL and one a graceful stop.
        before = [e.hard for e in out if e.kind == kind]
        if len(before) == 1:
            hard = not before[0]
        if kind == "stop":
            hold = lease_ttl_s + rng.uniform(1.0, 3.0)
        elif kind == "etcd_member":
            hold = rng.uniform(0.5, 3.0)
        elif kind == "etcd_all":  # sometimes longer than the lease TTL
            hold = rng.uniform(0.5, lease_ttl_s + 1.0)
        if not kind.startswith("etcd"):
            hard = False
        gap = rng.uniform(0.0, 1.0)
        out.append(Event(len(out), kind, round(pick, 4), round(hold, 2), hard, round(gap, 2)))

    while True:
        adds = sum(e.kind == "add" for e in out)
        if (not disruptions and live == peers and len(out) >= n_events
                and adds >= min_each):
            return out
        if not disruptions and len(out) < n_events:  # top up with fresh random disruptions
            disruptions.append(rng.choices(kinds, weights)[0])
        nxt = disruptions[-1] if disruptions else None
        must_add = live < peers and (
            nxt is None  # only adds are left to do
            or live - 1 < min_np  # the next disruption would go below min_np
            or (not disruptions and adds < min_each))
        if must_add or (live < peers and rng.random() < ADD_PROBABILITY):
            emit("add")
            live += 1
            continue
        if nxt is None:  # live == peers, disruptions done, but too few adds: one more crash
            disruptions.append("kill")
            continue
        kind = disruptions.pop()
        emit(kind)
        if kind in DEPARTURES:
            live -= 1


def seed_from_env(environ: dict[str, str] | None = None) -> int:
    """``$PEER_ELASTIC_CHAOS_SEED`` if set, else a fresh random seed."""
    raw = (os.environ if environ is None else environ).get(SEED_ENV, "").strip()
    return int(raw) if raw else secrets.randbelow(1_000_000_000)


def events_from_env(default: int = 20, environ: dict[str, str] | None = None) -> int:
    raw = (os.environ if environ is None else environ).get(EVENTS_ENV, "").strip()
    return int(raw) if raw else default


def training_epochs(n_events: int) -> int:
    """Epochs for WORKER_EPOCHS: long enough that the job ends after the schedule."""
    return BASE_EPOCHS + math.ceil(n_events * EPOCHS_PER_EVENT + 5 * math.sqrt(n_events))


# --- the runner --------------------------------------------------------------------------------


#: How long the children of a killed peer may outlive it: a DataLoader worker looks whether
#: its parent lives every 5 s (torch's MP_STATUS_CHECK_INTERVAL), on a loaded machine later.
ORPHANS_GONE_S = 20.0


def group_left(pgid: int) -> str | None:
    """None once process group ``pgid`` is empty (bounded: ORPHANS_GONE_S), else what is
    wrong. The orphans end on their own, with nothing to wait on but the group itself."""
    deadline = time.monotonic() + ORPHANS_GONE_S
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "exists (EPERM)"
        if time.monotonic() > deadline:
            return f"still has processes {ORPHANS_GONE_S:.0f} s after the end"
        time.sleep(0.1)  # sampling the group


class ChaosFailure(AssertionError):
    """The job (or the runner) went wrong; the message names the seed and shows the evidence."""


@dataclass(frozen=True)
class Held:
    """How :meth:`ChaosRunner.held` took peers away: for the log, which, and whether they
    kept their leases (a cut that spares etcd)."""

    how: str
    taken: list[Tracked]
    keeps_lease: bool


@dataclass
class Tracked:
    """One peer process the runner started, and what the runner knows about it."""

    proc: PeerProc
    spawned: float
    state: str = "running"  # running | stopped | killed | leaving | left
    joined_at: float | None = None  # when it printed "joined job" (registered in etcd)
    members: list[str] = field(default_factory=list)  # member ids, re-registrations too
    gen: tuple[int, int, int] | None = None  # its latest GEN line: (generation, rank, size)
    stops: int = 0
    scanned: int = 0  # lines of proc.lines parsed so far
    host: Host | None = None  # the host it runs on (the runner's ``hosts``), else None
    exited_0_at: float | None = None  # exited 0 before we saw the RESULT line

    @property
    def name(self) -> str:
        return self.proc.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int) -> list[str]:
        """Its last ``lines`` lines of output; the STEP lines crowd out the rest, so only the
        last STEP line is kept."""
        with self.proc.cond:
            all_lines = list(self.proc.lines)
        steps = [i for i, line in enumerate(all_lines) if line.startswith("STEP ")]
        return [line for i, line in enumerate(all_lines)
                if not line.startswith("STEP ") or (steps and i == steps[-1])][-lines:]


@dataclass
class Applied:
    """What the runner did for one event, and how long the job took to make progress again."""

    event: Event
    t: float  # seconds since the runner started
    target: str = ""
    role: str = ""  # roster | standby | etcd
    detail: str = ""
    settle_s: float = 0.0

    def line(self) -> str:
        who = f" {self.target}" if self.target else ""
        role = f" ({self.role})" if self.role else ""
        detail = f": {self.detail}" if self.detail else ""
        return (f"[{self.t:7.1f}s] {self.event.describe()}{who}{role}{detail}; "
                f"progress again after {self.settle_s:.1f}s")


class ChaosRunner:
    """Runs ``peers`` elastic_worker peers on ``etcd`` and applies ``schedule`` to them.

    ``start()``, ``run()``, ``finish()`` in that order, and ``close()`` always (it kills
    whatever is left; etcd members an event left down are the cluster owner's to stop). Each step raises
    :class:`ChaosFailure` with the seed, the events applied so far and the peers' output as
    soon as something is wrong (a peer exits on its own before the job finished, the job
    makes no progress within ``progress_timeout_s`` of an event, ...).
    """

    #: states (besides ``killed``) whose exit code is not checked; a subclass adds its own
    ANY_EXIT: tuple[str, ...] = ()

    def __init__(self, seed: int, schedule: list[Event], etcd: EtcdCluster, job: str, *,
                 peers: int = 5, min_np: int = 2, max_np: int = 4, epochs: int | None = None,
                 progress_steps: int = 3, progress_timeout_s: float = 120.0,
                 out: Callable[[str], None] = print, hosts: Hosts | None = None,
                 **settings: object) -> None:
        self.seed = seed
        # With ``hosts`` every peer runs on one of them (round robin, in start order): its
        # own network namespace, address and hostname, etcd reached over their bridge.
        self.hosts = hosts
        self.schedule = schedule
        self.etcd = etcd
        self.n_peers, self.min_np, self.max_np = peers, min_np, max_np
        self.n_start = peers  # peers start() starts (a subclass may start fewer)
        self.progress_steps = progress_steps
        self.progress_timeout_s = progress_timeout_s
        self._out = out
        # The job ends when finish() creates WORKER_END_FILE, after the last event settled,
        # not after a number of epochs guessed from the pace: on a loaded machine a slow
        # schedule outran that guess and the job finished before its last event.
        # The cap costs nothing per step (the oracle trains one epoch's row): a wide margin.
        self.epochs = epochs if epochs is not None else 4 * training_epochs(len(schedule))
        self._own_end_dir = None if "WORKER_END_FILE" in settings else tempfile.mkdtemp(
            prefix="chaos-end-")
        if self._own_end_dir is not None:
            settings["WORKER_END_FILE"] = Path(self._own_end_dir) / "end"
        self.end_file = Path(str(settings["WORKER_END_FILE"]))
        env = dict(SETTINGS, PEER_ELASTIC_MIN_NP=min_np, PEER_ELASTIC_MAX_NP=max_np,
                   WORKER_EPOCHS=self.epochs)
        env.update(settings)
        self.cluster = Cluster(etcd.endpoint_string, job, **env)
        self.peers: list[Tracked] = []
        self.applied: list[Applied] = []
        self.t0 = time.monotonic()
        self.max_gen = 0
        self.gen_sizes: dict[int, int] = {}
        self.steps: dict[tuple[int, int, int], float] = {}  # (epoch, batch, gen) -> first seen
        self.gen_steps: dict[int, list[float]] = {}  # generation -> first-seen times of its steps
        self.last_epoch = -1
        self.results: list[tuple[str, dict[str, Any]]] = []
        self.tracebacks: list[str] = []
        self.finished = False  # a RESULT line was seen: the job is over
        self.schedule_end_epoch = -1  # the epoch in progress when the last event settled

    # -- output and failure ---------------------------------------------------------------

    def say(self, msg: str) -> None:
        self._out(f"CHAOS [{time.monotonic() - self.t0:7.1f}s] {msg}")

    def tag(self) -> str:
        return f"CHAOS SEED {self.seed} (replay: {SEED_ENV}={self.seed})"

    def history(self) -> str:
        return "\n".join(a.line() for a in self.applied) or "(no event applied)"

    def fail(self, msg: str, peers: Iterable[Tracked] | None = None, lines: int = 60,
             stacks: bool = False) -> NoReturn:
        """Raise ChaosFailure with the history and the shown peers' output; with ``stacks``
        (a wait that timed out), the stacks of those still alive too."""
        shown = list(self.peers if peers is None else peers)
        parts = [f"{self.tag()}: {msg}", "events applied:", self.history()]
        for p in shown:
            tail = p.tail(lines)  # before the stacks, which arrive as output lines
            parts.append(f"--- {p.name} (pid {p.pid}, {p.state}, rc {p.proc.proc.poll()}, "
                         f"members {p.members}) last {len(tail)} lines but STEP:")
            parts.extend(tail)
            if stacks:
                parts.append(p.proc.dump_stacks())
                parts.append(native_stacks(p.pid))
        raise ChaosFailure("\n".join(parts))

    # -- peers ---------------------------------------------------------------------------------

    def spawn(self, **env: object) -> Tracked:
        # Each peer lists the etcd members in a different order, so a member outage hits
        # the peers talking to it and not the others.
        eps = self.etcd.endpoints
        k = len(self.peers) % len(eps)
        if self.hosts is None:
            (proc,) = self.cluster.start(1, PEER_ELASTIC_ETCD=",".join(eps[k:] + eps[:k]), **env)
        else:
            host = self.hosts.hosts[len(self.peers) % len(self.hosts.hosts)]
            bridged = [f"{self.hosts.bridge_ip4}:{m.client_port}" for m in self.etcd.members]
            (proc,) = self.cluster.start(1, place=host.place, where=host.name,
                                         PEER_ELASTIC_ETCD=",".join(bridged[k:] + bridged[:k]),
                                         **env)
        t = Tracked(proc, time.monotonic(), host=None if self.hosts is None else host)
        self.peers.append(t)
        return t

    def scan(self) -> None:
        """Parse the new output of every peer (GEN, STEP, RESULT, joins, tracebacks)."""
        now = time.monotonic()
        for p in self.peers:
            with p.proc.cond:
                new = p.proc.lines[p.scanned:]
                p.scanned += len(new)
            for line in new:
                if line.startswith(("STEP ", "GEN ")):
                    nums = _numbers(line)
                    if nums is None:  # cut short: a peer SIGKILLed while it printed
                        continue
                    if line.startswith("STEP "):
                        e, b, g = nums
                        if (e, b, g) not in self.steps:
                            self.steps[(e, b, g)] = now
                            self.gen_steps.setdefault(g, []).append(now)
                        self.last_epoch = max(self.last_epoch, e)
                    else:
                        g, _, size = nums
                        p.gen = nums
                        self.gen_sizes[g] = size
                        self.max_gen = max(self.max_gen, g)
                elif line.startswith("RESULT "):
                    try:
                        self.results.append((p.name, json.loads(line.split(" ", 1)[1])))
                    except ValueError:  # cut short: verify() finds no complete RESULT
                        self.results.append((p.name, {"unparsable": line}))
                    self.finished = True
                elif "Traceback" in line:
                    self.tracebacks.append(f"{p.name}: {line}")
                else:
                    m = _JOINED.search(line) or _REJOINED.search(line)
                    if m and m.group(1) not in p.members:
                        p.members.append(m.group(1))
                        if p.joined_at is None:
                            p.joined_at = now

    def check(self) -> None:
        """Fail at once if a peer that should be running has exited before the job ended."""
        self.scan()
        for p in self.peers:
            rc = p.proc.proc.poll()
            if rc is None or p.state in ("killed", "left", *self.ANY_EXIT):
                continue
            if p.state == "leaving":
                p.state = "left"
                if rc != 0:
                    self.fail(f"{p.name} was asked to leave (SIGTERM or drain) and exited "
                              f"with code {rc}, not 0", [p])
                continue
            if rc == 0 and not self.finished:
                # A standby sees the done record and exits, maybe before rank 0's RESULT
                # line reached us: give that line a little time.
                p.exited_0_at = p.exited_0_at or time.monotonic()
                if time.monotonic() - p.exited_0_at < 20.0:
                    continue
            if self.finished and rc == 0:
                continue
            self.fail(f"{p.name} ({p.state}) exited with code {rc} before the job finished",
                      [p])

    def running(self) -> list[Tracked]:
        return [p for p in self.peers if p.state == "running"]

    def roster(self) -> list[Tracked]:
        """Running peers whose latest GEN line is the newest generation."""
        return [p for p in self.running() if p.gen is not None and p.gen[0] == self.max_gen]

    def candidates(self) -> list[Tracked]:
        """Peers an event may hit: running, registered for at least a second (so the
        SIGTERM handler is installed)."""
        now = time.monotonic()
        return [p for p in self.running()
                if p.joined_at is not None and now - p.joined_at >= 1.0]

    def sleep(self, seconds: float) -> None:
        """Sleep, checking the peers meanwhile."""
        end = time.monotonic() + seconds
        while True:
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float | None = None,
                 peers: Iterable[Tracked] | None = None) -> bool:
        """Wait until ``cond()`` (True) or the job finished (False); fail on timeout."""
        deadline = time.monotonic() + (timeout or self.progress_timeout_s)
        while True:
            self.check()
            if cond():
                return True
            if self.finished:
                return False
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout or self.progress_timeout_s:.0f}s "
                          f"waiting for {what}", peers, stacks=True)
            time.sleep(0.1)

    def settled(self) -> bool:
        """The job is whole: every running, registered peer trains in the newest generation,
        or that generation is full (the rest are standbys)."""
        g = self.max_gen
        if self.gen_sizes.get(g, 0) >= self.max_np:
            return True
        return all(p.gen is not None and p.gen[0] == g
                   for p in self.running() if p.joined_at is not None)

    def wait_progress(self, what: str, above_gen: int | None = None,
                      steps: int | None = None) -> bool:
        """Wait until the job is whole again (:meth:`settled`, in a generation above
        ``above_gen`` if given) and its newest generation printed ``steps`` new STEP
        positions since this call: the job trains again."""
        need = self.progress_steps if steps is None else steps
        since = time.monotonic()

        def progressed() -> bool:
            g = self.max_gen
            if above_gen is not None and g <= above_gen:
                return False
            times = self.gen_steps.get(g, [])
            return len(times) >= need and times[-need] >= since and self.settled()

        return self.wait_for(f"progress after {what}", progressed)

    # -- etcd ----------------------------------------------------------------------------------

    @staticmethod
    def _signal_member(m: EtcdServer, sig: signal.Signals) -> None:
        pid = m.pid
        if pid is not None and m.running:  # running: not reaped, so the pid is still its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _sigterm_member(self, m: EtcdServer, timeout: float = 15.0) -> None:
        self._signal_member(m, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while m.running and time.monotonic() < deadline:
            self.sleep(0.05)
        if m.running:
            self.say(f"etcd {m.name} ignored SIGTERM for {timeout:.0f}s: SIGKILL")
        m.kill()  # reaps it (and closes its log); a no-op signal when it already exited

    def etcd_down(self, idxs: list[int], hard: bool) -> None:
        members = self.etcd.members
        if hard:
            for i in idxs:  # all at once, then reap them
                self._signal_member(members[i], signal.SIGKILL)
            for i in idxs:
                members[i].kill()
            return
        # Graceful: a leader told to stop hands leadership over first, so the followers go
        # first (together), the leader last (as EtcdCluster.stop does).
        leader = self.etcd.leader_index(timeout=1.0) if len(idxs) > 1 else None
        order = [i for i in idxs if i != leader] + ([leader] if leader in idxs else [])
        followers = [i for i in order if i != leader]
        for i in followers:
            self._signal_member(members[i], signal.SIGTERM)
        for i in order:
            self._sigterm_member(members[i])

    def etcd_up(self, idxs: list[int], timeout: float = 60.0) -> None:
        try:
            for i in idxs:
                self.etcd.start_member(i, wait=False)
            for i in idxs:  # together: after a full stop, none is healthy without a quorum
                self.etcd.members[i].wait_ready(timeout)
        except EtcdStartError as exc:
            self.fail(f"etcd did not come back: {exc}")

    # -- the run -------------------------------------------------------------------------------

    def start(self) -> None:
        self.say(f"{self.tag()}: {len(self.schedule)} events, {self.n_peers} peers "
                 f"(min_np {self.min_np}, max_np {self.max_np}), {self.epochs} epochs, "
                 f"etcd {self.etcd.endpoint_string}")
        counts = Counter(e.kind for e in self.schedule)
        self.say("schedule: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        self.say("schedule: " + ", ".join(e.describe() for e in self.schedule))
        for _ in range(self.n_start):
            self.spawn()
        first = min(self.n_start, self.max_np)
        self.wait_for(f"the first generation of {first}",
                      lambda: self.gen_sizes.get(self.max_gen) == first, timeout=180)
        self.wait_for("every peer to register",
                      lambda: all(p.joined_at is not None for p in self.peers), timeout=120)
        self.wait_progress("the start")
        self.say(f"training: generation {self.max_gen}, roster "
                 + ", ".join(p.name for p in self.roster()))

    def run(self) -> list[Applied]:
        for ev in self.schedule:
            if self.finished:
                self.say(f"the job finished before event {ev.describe()}: "
                         f"{len(self.applied)} of {len(self.schedule)} applied")
                break
            self.apply(ev)
        return self.applied

    def apply(self, ev: Event) -> Applied:
        """Apply one event, wait for the job to make progress again, then its gap."""
        a = Applied(ev, time.monotonic() - self.t0)
        began = time.monotonic()
        getattr(self, f"_do_{ev.kind}")(ev, a)
        a.settle_s = time.monotonic() - began
        self.applied.append(a)
        self.say(a.line() + f" [epoch {self.last_epoch}/{self.epochs}, gen {self.max_gen}]")
        if not self.finished:
            self.sleep(ev.gap_s)
        return a

    def _pick(self, ev: Event, a: Applied) -> tuple[Tracked, bool]:
        """The target peer and whether it is in the current roster."""
        self.wait_for(f"a peer to {ev.kind}",
                      lambda: len(self.candidates()) >= 1, timeout=120)
        cands = self.candidates()
        alive = len(self.running())
        if ev.kind != "add" and alive - 1 < self.min_np:
            self.fail(f"{ev.describe()} would leave {alive - 1} running peers (< min_np "
                      f"{self.min_np}): runner and schedule disagree")
        p = cands[min(int(ev.pick * len(cands)), len(cands) - 1)]
        in_roster = p in self.roster()
        a.target, a.role = f"{p.name}/pid {p.pid}", "roster" if in_roster else "standby"
        return p, in_roster

    def _settle_after_departure(self, ev: Event, a: Applied, g0: int, in_roster: bool) -> None:
        if in_roster:  # the job re-forms without it and trains on
            self.wait_progress(f"{ev.describe()} of {a.target}", above_gen=g0)
        else:
            self.wait_progress(f"{ev.describe()} of {a.target}")

    def _sigkill(self, p: Tracked) -> None:
        """SIGKILL ``p`` and reap it (its exit status is then expected)."""
        p.state = "killed"
        p.proc.signal(signal.SIGKILL)
        p.proc.proc.wait(timeout=30)

    def _do_kill(self, ev: Event, a: Applied) -> None:
        p, in_roster = self._pick(ev, a)
        g0 = self.max_gen
        self._sigkill(p)
        if ev.burst:
            a.detail = "the next event follows mid-reset"
            return
        self._settle_after_departure(ev, a, g0, in_roster)

    def _do_term(self, ev: Event, a: Applied) -> None:
        p, in_roster = self._pick(ev, a)
        self._leave_gracefully(ev, a, p, in_roster, "SIGTERM",
                               lambda: p.proc.signal(signal.SIGTERM))

    def _leave_gracefully(self, ev: Event, a: Applied, p: Tracked, in_roster: bool, how: str,
                          ask: Callable[[], object]) -> None:
        """Ask ``p`` to leave (``ask``: a signal, a drain), wait for it to exit, require exit
        code 0 and wait until the job trains on without it."""
        g0 = self.max_gen
        p.state = "leaving"
        ask()
        self.wait_for(f"{p.name} to leave on {how}",
                      lambda: p.proc.proc.poll() is not None, timeout=90, peers=[p])
        self.check()  # asserts its exit code 0
        self._settle_after_departure(ev, a, g0, in_roster)

    def lone_host(self, p: Tracked) -> Host | None:
        """``p``'s host when no other peer process lives there (several hosts only): cutting
        that host off then takes away ``p`` alone, as a SIGSTOP of ``p`` would."""
        if p.host is None or any(q is not p and q.host is p.host and q.proc.proc.poll() is None
                                 for q in self.peers):
            return None
        return p.host

    def host_mates(self, p: Tracked) -> list[Tracked]:
        """The other running peers on ``p``'s host (several hosts only)."""
        if p.host is None:
            return []
        return [q for q in self.running() if q is not p and q.host is p.host]

    def whole_host_takes(self, p: Tracked) -> list[Tracked]:
        """The peers that cutting off ``p``'s host with everyone on it takes away, when
        enough run elsewhere for the job to go on (at least ``min_np``); else just ``[p]``."""
        mates = self.host_mates(p)
        elsewhere = len(self.running()) - 1 - len(mates)
        return [p, *mates] if p.host is not None and elsewhere >= self.min_np else [p]

    @contextlib.contextmanager
    def held(self, p: Tracked, whole_host: bool = False,
             peers_only: bool = False) -> Iterator[Held]:
        """Take ``p`` away while the block runs: its host cut off from everything (a silent
        drop) when it is alone there, or when ``whole_host`` asks for a partition of every
        peer on it and enough peers run elsewhere (:meth:`whole_host_takes`); else SIGSTOP.
        ``peers_only``: a host cut spares etcd (the peers there keep their leases)."""
        hosts, host = self.hosts, self.lone_host(p)
        taken = [p]
        if hosts is not None and host is None and whole_host:
            taken = self.whole_host_takes(p)
            host = p.host if len(taken) > 1 else None
        for q in taken:
            q.state, q.stops = "stopped", q.stops + 1
        keeps_lease = False
        if hosts is not None and host is not None:
            if peers_only:
                try:
                    hosts.cut_from_peers(host)
                    keeps_lease = True
                except NetnsUnavailable as exc:
                    self.say(f"cutting {host.name} from its peers only failed ({exc}): "
                             "cutting it off from everything")
            if not keeps_lease:
                hosts.cut(host)
        else:
            p.proc.signal(signal.SIGSTOP)
        try:
            how = "SIGSTOP" if host is None else (
                f"{host.name} cut off" + (" from its peers" if keeps_lease else "")
                + (f" with {len(taken)} peers" if len(taken) > 1 else ""))
            yield Held(how, taken, keeps_lease)
        finally:
            if hosts is not None and host is not None:
                hosts.heal(host)
            else:
                p.proc.signal(signal.SIGCONT)
            for q in taken:
                q.state = "running"

    def _do_stop(self, ev: Event, a: Applied) -> None:
        p, in_roster = self._pick(ev, a)
        g0, roster = self.max_gen, self.roster()
        with self.held(p, getattr(ev, "whole_host", False),
                       getattr(ev, "peers_only", False)) as held:
            taken = held.taken
            registrations = {q.name: len(q.members) for q in taken}
            in_roster = in_roster or any(q in roster for q in taken)
            self.sleep(ev.hold_s)
        a.detail = f"{held.how}, back after {ev.hold_s:.1f}s (lease TTL {LEASE_TTL_S:.0f}s)"
        if held.keeps_lease:
            # Still members: left out once reported unreachable (or waited for, if healed
            # first), back under the same ids. The job must simply train on.
            a.detail += ", kept their leases"
            self.wait_progress(f"{ev.describe()} of {a.target}")
            return
        # Away past its TTL, each lost its lease: it must come back as a new member.
        for q in taken:
            if not self.wait_for(f"{q.name} to re-register after it came back",
                                 lambda q=q: len(q.members) > registrations[q.name],
                                 peers=[q]):
                return
        a.detail += ", back as " + ", ".join(q.members[-1] for q in taken)
        self._settle_after_departure(ev, a, g0, in_roster)

    def _do_add(self, ev: Event, a: Applied) -> None:
        if len(self.running()) >= self.n_peers:
            self.fail(f"{ev.describe()}: {len(self.running())} peers already running "
                      "(runner and schedule disagree)")
        p = self.spawn()
        a.target = f"{p.name}/pid {p.pid}"
        if not self.wait_for(f"{p.name} to register", lambda: p.joined_at is not None,
                             timeout=120, peers=[p]):
            return
        # It is appended to the roster if there is room, else it waits as the standby;
        # wait_progress waits for whichever it is (settled()).
        done = self.wait_progress(f"{ev.describe()} of {a.target}")
        a.role = "roster" if p.gen is not None else "standby" if done else "?"

    def _do_etcd_member(self, ev: Event, a: Applied) -> None:
        i = min(int(ev.pick * self.etcd.size), self.etcd.size - 1)
        leader = self.etcd.leader_index(timeout=1.0)
        a.target, a.role = f"etcd m{i}", "etcd"
        a.detail = "leader" if leader == i else "follower"
        self._etcd_outage(ev, a, [i])

    def _do_etcd_all(self, ev: Event, a: Applied) -> None:
        a.target, a.role = "etcd m0-m2", "etcd"
        self._etcd_outage(ev, a, list(range(self.etcd.size)))

    def _etcd_outage(self, ev: Event, a: Applied, idxs: list[int],
                     midway: Callable[[], int | None] | None = None) -> None:
        """Stop etcd members ``idxs`` for ``ev.hold_s``, restart them, and wait until the job
        trains again. ``midway``, if given, runs halfway through the outage and returns the
        generation the job must then train above (None: any)."""
        before = len(self.steps)
        self.etcd_down(idxs, ev.hard)
        down_at = time.monotonic()
        above_gen = None
        if midway is not None:
            self.sleep(ev.hold_s / 2)
            above_gen = midway()
        self.sleep(max(0.0, ev.hold_s - (time.monotonic() - down_at)))
        during = len(self.steps) - before
        self.etcd_up(idxs)
        a.detail += (f"{', ' if a.detail else ''}{'SIGKILL' if ev.hard else 'SIGTERM'}, down "
                     f"{time.monotonic() - down_at:.1f}s, {during} STEP positions meanwhile")
        self.wait_progress(ev.describe(), above_gen=above_gen)

    def finish(self, timeout: float = 300.0) -> dict[str, Any]:
        """Wait for the job to end and every peer to exit; return rank 0's RESULT."""
        self.schedule_end_epoch = self.last_epoch
        self.end_file.touch()
        self.say(f"schedule done ({len(self.applied)} events) at epoch {self.last_epoch}: "
                 "ending the job")
        self.wait_for("the job to finish (RESULT)", lambda: self.finished, timeout=timeout)
        return self.wait_all_exited()

    def wait_all_exited(self) -> dict[str, Any]:
        """Once the job finished: every peer exits (bounded); rank 0's RESULT."""
        deadline = time.monotonic() + 120.0
        while any(p.proc.proc.poll() is None for p in self.peers):
            self.check()
            if time.monotonic() > deadline:
                self.fail("peers still running 120s after the job finished: " + ", ".join(
                    p.name for p in self.peers if p.proc.proc.poll() is None), stacks=True)
            time.sleep(0.1)
        self.check()
        self.say(f"job finished: {self.results[-1][1]}")
        return self.results[-1][1]

    def verify(self, result: dict[str, Any]) -> list[str]:
        """Everything that is wrong at the end (empty when the run passed)."""
        problems = []
        if len(self.results) != 1:
            problems.append(f"{len(self.results)} RESULT lines (want 1): {self.results}")
        if not (result.get("exact") and result.get("identical")):
            problems.append(f"oracle failed: {result}")
        if result.get("world", 0) < self.min_np:
            problems.append(f"final world {result.get('world')} < min_np {self.min_np}")
        if len(self.applied) < len(self.schedule):
            problems.append(f"only {len(self.applied)} of {len(self.schedule)} events applied "
                            f"(the job reached WORKER_EPOCHS first: raise EPOCHS_PER_EVENT)")
        # Reset callbacks run once state is synced: within a generation every rank holds
        # the same state there (the worker prints its digest; DDP is rebuilt there).
        digests = callback_digests([p.proc for p in self.peers])
        split = {g: len(d) for g, d in digests.items() if len(d) > 1}
        if split:
            problems.append(f"ranks held different states in the reset callbacks of "
                            f"generations {split} (generation: distinct digests)")
        for p in self.peers:
            rc = p.proc.proc.poll()
            if p.state not in ("killed", *self.ANY_EXIT) and rc != 0:
                problems.append(f"{p.name} ({p.state}, stopped {p.stops}x) exited {rc}, not 0")
            if rc is None:
                problems.append(f"{p.name} (pid {p.pid}) is still running")
            try:
                assert_no_thread_of_ours_left(p.proc)
            except AssertionError as exc:
                problems.append(str(exc).split("\n", 1)[0])
            # Its own session: nothing of it (children included) may be left.
            if (left := group_left(p.pid)) is not None:
                problems.append(f"process group {p.pid} of {p.name} {left}")
        return problems

    def summary(self) -> str:
        counts = Counter(a.event.kind for a in self.applied)
        roles = Counter(f"{a.event.kind}:{a.role}" for a in self.applied)
        rcs = ", ".join(f"{p.name}={p.proc.proc.poll()}({p.state}"
                        f"{f', stopped {p.stops}x' if p.stops else ''})" for p in self.peers)
        rejoins = sum(max(0, len(p.members) - 1) for p in self.peers)
        slowest = max(self.applied, key=lambda a: a.settle_s, default=None)
        slow = f"slowest: {slowest.line()}; " if slowest else ""
        tbs = f" ({'; '.join(self.tracebacks[:3])})" if self.tracebacks else ""
        return (f"{self.tag()}: {len(self.applied)} events "
                f"({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}), by role "
                f"{dict(sorted(roles.items()))}; {self.max_gen} generations, {rejoins} "
                f"re-registrations after a lost lease; schedule done at epoch "
                f"{self.schedule_end_epoch} of {self.epochs}; {len(self.peers)} peers: {rcs}; "
                f"{slow}{len(self.tracebacks)} traceback lines{tbs}; "
                f"{time.monotonic() - self.t0:.0f}s")

    def dump(self, directory: str | os.PathLike[str]) -> str:
        """Write every peer's full output and the event history under ``directory``."""
        os.makedirs(directory, exist_ok=True)
        for p in self.peers:
            with p.proc.cond:
                text = "\n".join(p.proc.lines)
            with open(os.path.join(directory, f"{p.name}.log"), "w") as f:
                f.write(f"# pid {p.pid} {p.state} rc {p.proc.proc.poll()} members {p.members}\n")
                f.write(text + "\n")
        with open(os.path.join(directory, "events.log"), "w") as f:
            f.write(f"{self.tag()}\n{self.history()}\n")
        for m in self.etcd.members:
            with contextlib.suppress(OSError):
                with open(os.path.join(directory, f"etcd-{m.name}.log"), "w") as f:
                    f.write(m.log_tail(400))
        return str(directory)

    def close(self) -> None:
        """Kill every peer still running (SIGCONT first, so a stopped one dies too)."""
        self.cluster.close()  # PeerProc.kill: SIGCONT + SIGKILL to its process group, reap
        if self._own_end_dir is not None:
            shutil.rmtree(self._own_end_dir, ignore_errors=True)


def run_chaos(etcd: EtcdCluster, job: str, seed: int, n_events: int, *,
              out: Callable[[str], None] = print, finish_timeout_s: float | None = None,
              log_dir: str | os.PathLike[str] | None = None, min_each: int = 2,
              **kwargs: Any) -> tuple[ChaosRunner, dict[str, Any], list[str]]:
    """The whole run: schedule (every kind at least ``min_each`` times), start, apply,
    finish, verify. Returns the runner (its ``applied`` and ``summary()``), rank 0's RESULT
    and the problems found (empty: passed). With ``log_dir``, every peer's full output and
    the etcd logs are written there."""
    out(f"CHAOS SEED {seed}")
    schedule = make_schedule(seed, n_events, min_each=min_each)
    runner = ChaosRunner(seed, schedule, etcd, job, out=out, **kwargs)
    try:
        runner.start()
        runner.run()
        result = runner.finish(finish_timeout_s or 120.0 + 2.0 * runner.epochs)
        problems = runner.verify(result)
        out(runner.summary())
    except ChaosFailure:
        out(runner.summary())
        raise
    except Exception as exc:  # a runner bug or an etcd failure: still name the seed
        out(runner.summary())
        raise ChaosFailure(f"{runner.tag()}: {exc!r}\nevents applied:\n{runner.history()}"
                           ) from exc
    finally:
        if log_dir is not None:
            out(f"CHAOS SEED {seed}: peer and etcd logs in {runner.dump(log_dir)}")
        runner.close()
    return runner, result, problems
