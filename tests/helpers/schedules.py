"""Model-based schedules: a seeded mix of a documented API pattern and a sequence of events,
applied to a real elastic job, ending with the exactly-once oracle (issue 9).

``make_plan(seed)`` is a pure function of the seed. It draws a job *shape* (how many peers
run at most, ``min_np``, ``max_np``: :data:`SHAPES`, two peers to five), an API *pattern* (how the
worker records progress, how often it commits, whether it checks for host updates between
commits, plain values in the state, DDP rebuilt in a reset callback, half of those over a
subgroup, which the callback or the training function makes: the WORKER_* knobs of
``tests/helpers/elastic_worker.py``; in a quarter of the plans, durable snapshots written
while the events happen) and then a sequence of events under a model of the job
(running peers, ``max_np``, ``min_np``, paused), so that no event takes the roster below
``min_np``. :class:`ScheduleRunner` extends :class:`tests.helpers.chaos.ChaosRunner` (which
already applies kill, term, add, long SIGSTOP and etcd restarts, spaces events by waiting
for STEP/GEN progress and checks exit codes) with the remaining kinds:

* ``kill``          SIGKILL a peer; ``target="leader"``: rank 0 of the newest generation,
                    ``"other"``: a roster member that is not rank 0. A share of the kills
                    (``BURST_SHARE``, drawn apart from the rest of the plan) are *bursts*:
                    the next event follows within 0.3 s, without waiting for the job to
                    re-form, so it lands in the middle of the reset.
* ``term``          SIGTERM a peer (graceful leave; exits 0); ``target`` as for kill.
* ``drain``         ``peer-elastic drain <member id>`` of a running peer (roster or standby):
                    the same graceful leave asked for from outside; it must exit 0.
* ``train``         no disturbance: wait for ``value`` more STEP positions (scripted plans).
* ``add``           start a new peer (joins, or waits as a standby).
* ``set_max``       ``peer-elastic set max_np=<value>``: down parks roster members as
                    standbys, up brings them back.
* ``set_min``       ``peer-elastic set min_np=<value>``.
* ``pause``/``resume``  ``peer-elastic pause`` / ``resume`` (joiners wait while paused).
* ``stop_short``    SIGSTOP shorter than ``join_timeout_s``, then SIGCONT (nobody is dropped).
* ``stop_mid``      SIGSTOP longer than ``join_timeout_s`` but shorter than the lease TTL: the
                    peer misses the acks of a generation formed meanwhile (and is dropped from
                    it). It keeps its lease unless the stop outlasts what the last refresh left
                    (a refresh every TTL/3): then it rejoins as after a ``stop``, paused or not.
                    Drawn apart, in place of a share of the short stops.
* ``stop``          SIGSTOP longer than ``join_timeout_s`` and the lease TTL, then SIGCONT
                    (the peer loses its lease and comes back as a new member).
                    On several hosts (``hosts=``: every peer on one of them, round robin) a
                    peer alone on its host is taken away by cutting that host off instead
                    (a silent drop of every packet, then healed), for both kinds of stop.
                    Half the stops (``whole_host``, drawn apart from the rest of the plan)
                    cut off the host even when other peers run there, a partition of all of
                    them, where enough peers run elsewhere to go on (else SIGSTOP).
                    Half the long stops that cut a host (``peers_only``, drawn apart too)
                    cut it from the other hosts only, not from etcd, for 4.5-16 s: its peers
                    keep their leases, the others must leave them out or wait, and they
                    rejoin under the same member ids once healed.
* ``hang``          the training thread of a roster peer blocks forever while its process
                    lives (``WORKER_HANG_FILE``). Only generated when the library has hang
                    detection (:func:`hang_detection`); the others must train again within
                    ``hang_timeout_s`` + 10 s.
* ``etcd_member``/``etcd_all``  kill (or stop) and restart one / all etcd members. A share of
                    the whole-etcd outages (``LONG_OUTAGE_SHARE``, drawn apart) last two to
                    four lease TTLs (maintenance, a lost etcd host), and in a share of them
                    (``kill_during``, drawn apart too) a running peer is SIGKILLed halfway
                    through: a machine lost while nobody can write a new generation.
* ``restart``       (plans with durable snapshots only) SIGKILL every running peer at once and
                    start as many again: they resume from the newest snapshot, never from an
                    older one (checked on their first START line). Variants (``variant``,
                    drawn apart): ``park``: ``set max_np`` first parks one roster member, the
                    others train on and write snapshots, then only they are killed (the parked
                    peer lives on with an older state in memory) and ``max_np`` goes back;
                    ``lower``: the newest snapshot is hidden while the job restarts, so it
                    resumes at a lower commit count, and is put back once the new lineage has
                    written a snapshot of its own (retention and later restarts must prefer
                    the new lineage); ``slow``: the restarted peers take longer than
                    ``collective_timeout_s`` to verify the snapshot they load.

The job is given a generous epoch cap and ended as soon as the schedule is done
(``WORKER_END_FILE``); the oracle then checks exactly the epochs trained. Every message
names the seed and the pattern; replay with ``PEER_ELASTIC_SCHEDULE_SEED=<seed>``.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from peer_elastic.config import JOB_FIELDS
from peer_elastic.durable.layout import Manifest, SnapshotDir
from peer_elastic.settings_table import HANG_FIRST_STEP
from peer_elastic.testing import EtcdCluster
from tests.helpers.chaos import SETTINGS, Applied, ChaosFailure, ChaosRunner, Event, Tracked
from tests.helpers.procs import ROOT

SEED_ENV = "PEER_ELASTIC_SCHEDULE_SEED"
EVENTS_ENV = "PEER_ELASTIC_SCHEDULE_EVENTS"

JOIN_TIMEOUT_S = float(SETTINGS["PEER_ELASTIC_JOIN_TIMEOUT"])  # type: ignore[arg-type]
LEASE_TTL_S = float(SETTINGS["PEER_ELASTIC_LEASE_TTL"])  # type: ignore[arg-type]
COLLECTIVE_TIMEOUT_S = float(SETTINGS["PEER_ELASTIC_COLLECTIVE_TIMEOUT"])  # type: ignore[arg-type]
HANG_TIMEOUT_S = 10.0  # PEER_ELASTIC_HANG_TIMEOUT for the job, when the library has it

def hang_detection() -> dict[str, Any] | None:
    """The library's training-thread hang detection setting (name, env), or None before it
    exists: ``hang`` events are generated only when it does."""
    for f in JOB_FIELDS:
        if f.name == "hang_timeout_s":
            return {"name": f.name, "env": f.env}
    return None


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pattern:
    """One documented way to use the API, as elastic_worker knobs."""

    record: str = "batch"  # batch | indices | local
    commit_every: int = 2
    check_every: int = 0  # 0: never; else state.check_host_updates() every j-th non-commit step
    plain: bool = False
    ddp: bool = False
    # DDP reduces over a subgroup: "" none, "1" the reset callback makes it, "train" the
    # training function does.
    ddp_subgroup: str = ""
    # DDP averages with pe.allreduce_hook: the reset vote rides on its gradient all-reduce.
    ddp_hook: bool = False
    # Durable snapshots on (PEER_ELASTIC_SNAPSHOT_DIR in the run's work dir, every 0.5 s):
    # rank 0 writes them in the background while the events happen.
    snapshots: bool = False
    # Every peer forks, each time it enters its training function, a DataLoader worker and a
    # multiprocessing helper (which it terminate()s at the next entry): children that hold
    # copies of its descriptors and signal handlers through every event. It also runs a
    # program there that keeps what it inherits until 3 s after the peer ends: with DDP over
    # a subgroup the training function makes, a killed peer's subgroup connections.
    forks: bool = False
    # The model is a pe.ShardedState: "" no, "fsdp" (FSDP2 over every rank) or "hsdp:2"
    # (HSDP, shard groups of 2 where the world size allows): no DDP and no forks then.
    sharded: str = ""
    # The training loop calls sampler.set_epoch(state.epoch) at the START of every epoch too
    # (DistributedSampler's habit), so a reset re-enters it in the middle of an epoch.
    epoch_at_start: bool = False

    def env(self) -> dict[str, object]:
        return {"WORKER_SHARDED": self.sharded, "WORKER_RECORD": self.record, "WORKER_COMMIT_EVERY": self.commit_every,
                "WORKER_CHECK_EVERY": self.check_every, "WORKER_PLAIN": int(self.plain),
                "WORKER_DDP": int(self.ddp), "WORKER_DDP_SUBGROUP": self.ddp_subgroup,
                "WORKER_DDP_HOOK": int(self.ddp_hook),
                "WORKER_LOADER_WORKERS": int(self.forks),
                "WORKER_FORKED_HELPER": int(self.forks),
                "WORKER_EXEC_CHILD": "linger" if self.forks else "",
                "WORKER_SET_EPOCH_AT_START": int(self.epoch_at_start)}

    def describe(self) -> str:
        where = {"": "", "1": " (over a subgroup)",
                 "train": " (over a subgroup the training function makes)"}
        ddp = (f"ddp={int(self.ddp)}" + where[self.ddp_subgroup]
               + (" with pe.allreduce_hook" if self.ddp_hook else ""))
        return (f"record={self.record} commit_every={self.commit_every} "
                f"check_every={self.check_every} plain={int(self.plain)} {ddp}"
                + (" snapshots=1" if self.snapshots else "")
                + (" forks=1" if self.forks else "")
                + (f" sharded={self.sharded}" if self.sharded else "")
                + (" set_epoch_at_start=1" if self.epoch_at_start else ""))


def make_pattern(rng: random.Random) -> Pattern:
    record = rng.choice(["batch", "indices", "local"])
    commit_every = rng.choice([1, 2, 5])
    check_every = rng.choice([0, 1]) if commit_every > 1 else 0
    return Pattern(record, commit_every, check_every, rng.random() < 0.5, rng.random() < 0.25)


@dataclass(frozen=True)
class SEvent(Event):
    """A chaos :class:`Event` plus what the new kinds need."""

    value: int = 0  # set_max / set_min: the new value; train: STEP positions to wait for
    target: str = ""  # kill/term: "leader" (rank 0 of the newest generation), "other" (a
    #                   roster member that is not rank 0) or "" (any running peer)
    whole_host: bool = False  # stop/stop_short/stop_mid on several hosts: cut the peer's host off
    #                   with every peer on it, where enough peers run elsewhere (a partition)
    peers_only: bool = False  # stop on several hosts, where it cuts a host: from the other
    #                   hosts only, not from etcd (the peers there keep their leases)
    kill_during: bool = False  # etcd_all: a running peer is SIGKILLed halfway through the
    #                   outage (the others can form no generation without it until etcd is back)
    variant: str = ""  # restart: "" (plain), "park", "lower" or "slow" (see the module doc)

    def _describe(self) -> str:
        if self.kind in ("set_max", "set_min"):
            return f"#{self.index} {self.kind}={self.value}"
        host = " (its whole host, where several hosts)" if self.whole_host else ""
        if self.peers_only:
            host += " (from its peers only, where a host is cut)"
        if self.kind in ("stop_short", "stop_mid"):
            return f"#{self.index} {self.kind} for {self.hold_s:.1f}s{host}"
        if self.kind == "stop":
            return super()._describe() + host
        if self.kind == "train":
            return f"#{self.index} train {self.value} STEP positions"
        if self.kill_during:
            return super()._describe() + ", a peer SIGKILLed halfway"
        if self.kind == "restart" and self.variant:
            return f"#{self.index} restart ({self.variant})"
        if self.kind in ("kill", "term") and self.target:
            return f"#{self.index} {self.kind} {self.target}"
        return super()._describe()


@dataclass(frozen=True)
class Plan:
    seed: int
    pattern: Pattern
    events: list[SEvent]
    peers: int = 4  # never more running at once
    min_np: int = 2
    max_np: int = 3
    start: int | None = None  # started at the beginning (None: ``peers``)

    def describe(self) -> str:
        return (f"seed {self.seed}; pattern {self.pattern.describe()}; {self.peers} peers, "
                f"min_np {self.min_np}, max_np {self.max_np}; events: "
                + ", ".join(e.describe() for e in self.events))


# Weights of the kinds the generator draws (where the model allows them).
WEIGHTS = {"kill": 3, "kill_leader": 2, "term": 2, "drain": 1, "add": 3, "set_max": 2, "set_min": 1,
           "pause": 1, "stop_short": 2, "stop": 1, "etcd_member": 1, "etcd_all": 1, "hang": 1}
PAUSED_KINDS = ("add", "stop_short", "etcd_member", "resume")
#: The share of kills after which the next event follows at once, in the middle of the reset.
BURST_SHARE = 0.35
#: The share of stops that cut off the peer's host with every peer on it (several hosts only).
WHOLE_HOST_SHARE = 0.5
#: The share of long stops whose host cut spares etcd (a data network cut), and how long.
PEER_CUT_SHARE = 0.5
PEER_CUT_HOLD_S = (4.5, 16.0)
#: The share of short stops that last past the join timeout but not the lease TTL, and how
#: long (stop_mid).
MID_STOP_SHARE = 0.35
MID_STOP_HOLD_S = (1.1 * JOIN_TIMEOUT_S, 0.9 * LEASE_TTL_S)
#: The share of whole-etcd outages that last several lease TTLs, and how long: beyond every
#: lease's TTL, which etcd renews when it is back, while the peers train on.
LONG_OUTAGE_SHARE = 0.3
LONG_OUTAGE_HOLD_S = (2.0 * LEASE_TTL_S, 4.0 * LEASE_TTL_S)
#: The share of whole-etcd outages during which a running peer is SIGKILLed (kill_during).
OUTAGE_KILL_SHARE = 0.3


#: Job shapes, ``(peers, min_np, max_np)``: ``peers`` is the most running at once (the rest
#: beyond ``max_np`` wait as standbys). The first is the shape every plan had before shapes
#: were drawn; the others are what users also run: two peers where a crash leaves one to train
#: alone, ``min_np=1``, no standby, a roster of four, five peers. Never ``max_np=1``: a kill of
#: the only roster member leaves nobody holding the state (peer_elastic.state.lost_state).
SHAPES = ((4, 2, 3), (2, 1, 2), (3, 1, 2), (3, 2, 3), (4, 1, 4), (3, 1, 3), (5, 2, 4))
#: The share of plans with the first shape.
FIRST_SHAPE_SHARE = 0.4
#: The share of plans with durable snapshots on (Pattern.snapshots).
SNAPSHOT_SHARE = 0.25
FORKS_SHARE = 0.3  # plans whose peers fork children (Pattern.forks)
SHARDED_SHARE = 0.3  # plans whose model is sharded (Pattern.sharded)
EPOCH_AT_START_SHARE = 0.3  # plans whose loop also sets the epoch at its start
HSDP_SHARE = 0.4  # of those, HSDP rather than FSDP
#: How often rank 0 writes a snapshot in those plans (PEER_ELASTIC_SNAPSHOT_EVERY).
SNAPSHOT_EVERY_S = 0.5
#: In those plans, the share of events (while not paused) that a whole-job restart follows.
RESTART_SHARE = 0.12
#: The restart variants (SEvent.variant) and their shares; the rest are plain restarts.
RESTART_VARIANTS = {"park": 0.25, "lower": 0.2, "slow": 0.15}
#: How much longer than the collective timeout a ``slow`` restart's verification takes.
SLOW_RESUME_EXTRA_S = 2.0


def draw_shape(seed: int) -> tuple[int, int, int]:
    """The job shape of ``seed``'s plan (drawn apart from the rest of the plan)."""
    rng = random.Random(f"{seed}/shape")
    if rng.random() < FIRST_SHAPE_SHARE:
        return SHAPES[0]
    return rng.choice(SHAPES[1:])


def make_plan(seed: int, n_events: int = 8, *, peers: int | None = None,
              min_np: int | None = None, max_np: int | None = None,
              hang: bool | None = None) -> Plan:
    """The seeded plan: a job shape, a pattern and at least ``n_events`` events; it ends with
    the settings back at ``min_np``/``max_np`` and the roster not paused.

    The shape (``peers``, ``min_np``, ``max_np``) is drawn from :data:`SHAPES` unless given.

    The model: ``live`` running peers (roster and standbys), ``mx``/``mn`` the current
    max_np/min_np. A departure (kill, term, drain, hang), a long stop (which lasts one event) or a
    ``set`` never takes the roster, ``min(live, mx)``, below ``mn``; an add never makes
    ``live`` exceed ``peers``. While paused only adds, short stops and etcd member restarts
    happen (then ``resume``).
    """
    if hang is None:
        hang = hang_detection() is not None
    drawn = draw_shape(seed)
    peers = drawn[0] if peers is None else peers
    min_np = drawn[1] if min_np is None else min_np
    max_np = drawn[2] if max_np is None else max_np
    if not 1 <= min_np <= max_np <= peers:
        raise ValueError(f"need 1 <= min_np <= max_np <= peers, not {min_np}, {max_np}, {peers}")
    rng = random.Random(seed)
    # Which kills are bursts: drawn apart, so that the rest of a seed's plan stays as it was.
    bursts = random.Random(f"{seed}/burst")
    # Which stops take a peer's whole host away: drawn apart too (see SEvent.whole_host).
    cuts = random.Random(f"{seed}/host")
    # Which long stops cut a host from its peers only (SEvent.peers_only): drawn apart too.
    peer_cuts = random.Random(f"{seed}/peercut")
    pattern = make_pattern(rng)
    # Which short stops last beyond the join timeout (stop_mid): drawn apart too.
    mids = random.Random(f"{seed}/stopmid")
    # Where a whole-job restart follows an event (snapshot plans only): drawn apart too.
    restarts = random.Random(f"{seed}/restart")
    # Which whole-etcd outages last several TTLs, and which lose a peer: drawn apart too.
    long_outages = random.Random(f"{seed}/long-outage")
    outage_kills = random.Random(f"{seed}/outage-kill")
    restart_kinds = random.Random(f"{seed}/restart-kind")
    if pattern.ddp and random.Random(f"{seed}/subgroup").random() < 0.5:  # drawn apart
        where = "train" if random.Random(f"{seed}/subgroup-where").random() < 0.5 else "1"
        pattern = replace(pattern, ddp_subgroup=where)
    if pattern.ddp and random.Random(f"{seed}/ddp-hook").random() < 0.5:  # drawn apart
        pattern = replace(pattern, ddp_hook=True)
    if random.Random(f"{seed}/snapshots").random() < SNAPSHOT_SHARE:  # drawn apart
        pattern = replace(pattern, snapshots=True)
    if random.Random(f"{seed}/forks").random() < FORKS_SHARE:  # drawn apart
        pattern = replace(pattern, forks=True)
    if random.Random(f"{seed}/sharded").random() < SHARDED_SHARE:  # drawn apart
        mesh = "hsdp:2" if random.Random(f"{seed}/sharded-mesh").random() < HSDP_SHARE else "fsdp"
        pattern = replace(pattern, sharded=mesh, ddp=False, ddp_subgroup="", ddp_hook=False,
                          forks=False)
    if random.Random(f"{seed}/epoch-at-start").random() < EPOCH_AT_START_SHARE:  # drawn apart
        pattern = replace(pattern, epoch_at_start=True)
    out: list[SEvent] = []
    live, mx, mn, paused = peers, max_np, min_np, False

    def emit(kind: str, **kw: Any) -> None:
        pick = round(rng.random(), 4)
        hold = 0.0
        hard = False
        if kind == "stop":
            hold = LEASE_TTL_S + rng.uniform(1.0, 3.0)
        elif kind == "stop_short":
            hold = rng.uniform(0.2, 0.6) * JOIN_TIMEOUT_S
        elif kind == "etcd_member":
            hold, hard = rng.uniform(0.5, 3.0), rng.random() < 0.5
        elif kind == "etcd_all":
            hold, hard = rng.uniform(0.5, LEASE_TTL_S + 1.0), rng.random() < 0.5
            if long_outages.random() < LONG_OUTAGE_SHARE:
                hold = long_outages.uniform(*LONG_OUTAGE_HOLD_S)
        gap = round(rng.uniform(0.0, 1.0), 2)
        burst = kind == "kill" and bursts.random() < BURST_SHARE
        if burst:
            gap = round(bursts.uniform(0.0, 0.3), 2)
        if kind in ("stop", "stop_short"):
            kw["whole_host"] = cuts.random() < WHOLE_HOST_SHARE
        if kind == "stop" and peer_cuts.random() < PEER_CUT_SHARE:
            kw["peers_only"] = True
            hold = peer_cuts.uniform(*PEER_CUT_HOLD_S)
        if kind == "stop_short" and mids.random() < MID_STOP_SHARE:
            kind, hold = "stop_mid", mids.uniform(*MID_STOP_HOLD_S)
        out.append(SEvent(len(out), kind, pick, round(hold, 2), hard, gap, burst, **kw))

    def can_lose_one() -> bool:
        return min(live - 1, mx) >= mn

    while len(out) < n_events:
        if paused:
            allowed = [k for k in PAUSED_KINDS if k != "add" or live < peers]
            kind = rng.choice(allowed)
        else:
            allowed = {k: w for k, w in WEIGHTS.items() if (
                (k in ("kill", "kill_leader", "term", "drain", "stop") and can_lose_one())
                or (k == "hang" and hang and can_lose_one())
                or (k == "add" and live < peers)
                or (k == "set_max" and (mx != max_np or max(mn, 2) < mx))
                or (k == "set_min" and (mn != min_np or min(live - 1, mx) > mn))
                or k in ("pause", "stop_short", "etcd_member", "etcd_all"))}
            kind = rng.choices(list(allowed), list(allowed.values()))[0]
        if kind in ("kill", "kill_leader"):
            emit("kill", target="leader" if kind == "kill_leader" else "")
            live -= 1
        elif kind in ("term", "drain", "hang"):
            emit(kind)
            live -= 1
        elif kind == "add":
            emit("add")
            live += 1
        elif kind == "set_max":
            if mx != max_np:  # back up (to the original cap)
                mx = max_np
            else:
                mx = rng.randint(max(mn, 2), mx - 1)
            emit("set_max", value=mx)
        elif kind == "set_min":
            mn = min_np if mn != min_np else rng.randint(mn + 1, min(live - 1, mx))
            emit("set_min", value=mn)
        elif kind == "etcd_all":
            kill = can_lose_one() and outage_kills.random() < OUTAGE_KILL_SHARE
            emit("etcd_all", kill_during=kill)
            if kill:
                live -= 1
        elif kind == "pause":
            paused = True
            emit("pause")
        elif kind == "resume":
            paused = False
            emit("resume")
        else:  # stop, stop_short, etcd_*: nobody is gone afterwards
            emit(kind)
        if pattern.snapshots and not paused and len(out) < n_events \
                and restarts.random() < RESTART_SHARE:
            # Drawn apart, with a gap of its own: the plan's other draws stay as they were.
            variant, draw = "", restart_kinds.random()
            for name, share in RESTART_VARIANTS.items():
                if draw < share:
                    variant = name
                    break
                draw -= share
            # Parking one needs a roster of two that may lose one (max_np >= min_np).
            if variant == "park" and not (min(live, mx) >= 2 and min(live, mx) - 1 >= mn):
                variant = ""
            out.append(SEvent(len(out), "restart", gap_s=round(restarts.uniform(0.0, 1.0), 2),
                              variant=variant))
    if out[-1].burst:  # nothing follows to land mid-reset
        out[-1] = replace(out[-1], burst=False)
    if paused:
        emit("resume")
    if mn != min_np:  # lower first: min_np <= max_np holds after every single change
        emit("set_min", value=min_np)
    if mx != max_np:
        emit("set_max", value=max_np)
    return Plan(seed, pattern, out, peers, min_np, max_np)


def _newer(found: Manifest | None, than: Manifest | None) -> bool:
    return found is not None and (than is None or found.id > than.id)


def _first_start(p: Tracked, after: int) -> list[str] | None:
    """The fields of ``p``'s first START line after its ``after``-th line."""
    with p.proc.cond:
        return next((line.split()[1:] for line in p.proc.lines[after:]
                     if line.startswith("START ")), None)


def seed_from_env(environ: dict[str, str] | None = None) -> int | None:
    raw = (os.environ if environ is None else environ).get(SEED_ENV, "").strip()
    return int(raw) if raw else None


#: Set by pytest-xdist in every worker of a run: the run's id, the same in all of them.
RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"


def fresh_seeds(n: int, name: str = "") -> list[int]:
    """``[$PEER_ELASTIC_SCHEDULE_SEED]`` when set (a replay), else ``n`` fresh seeds.

    The seeds are part of the test ids, and the workers of a run spread over pytest-xdist
    each collect the tests: there they must agree, so the seeds come from the run's id (fresh
    for every run), drawn apart for each ``name``."""
    s = seed_from_env()
    if s is not None:
        return [s]
    run_id = os.environ.get(RUN_ID_ENV)
    if run_id:
        rng = random.Random(f"{run_id}:{name}")
        return [rng.randrange(1_000_000_000) for _ in range(n)]
    return [secrets.randbelow(1_000_000_000) for _ in range(n)]


def events_from_env(default: int) -> int:
    raw = os.environ.get(EVENTS_ENV, "").strip()
    return int(raw) if raw else default


def epoch_cap(n_events: int) -> int:
    """WORKER_EPOCHS: far more than the schedule needs (the job is ended by WORKER_END_FILE
    once the schedule is done; the cap only sizes the oracle's per-epoch summaries, which
    no step pays for)."""
    return 120 + 32 * n_events


# --- the runner --------------------------------------------------------------------------------


class ScheduleRunner(ChaosRunner):
    """Applies a :class:`Plan` to a real job (see the module doc for the kinds)."""

    ANY_EXIT = ("hung",)

    def __init__(self, plan: Plan, etcd: EtcdCluster, job: str, workdir: str | os.PathLike[str],
                 *, progress_timeout_s: float = 90.0, **kwargs: Any) -> None:
        self.plan = plan
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.end_file = self.workdir / "end"
        self.hang_file = self.workdir / "hang"
        env: dict[str, object] = dict(plan.pattern.env(), WORKER_END_FILE=self.end_file,
                                      WORKER_HANG_FILE=self.hang_file)
        hd = hang_detection()
        if hd is not None:
            env[hd["env"]] = HANG_TIMEOUT_S
            # The peer picked may hang before its first step since a reset: that, too, must
            # be found within HANG_TIMEOUT_S (0: no longer allowance for the first step).
            env[HANG_FIRST_STEP.env] = 0
        if plan.pattern.snapshots:  # the hosts of a multi-host run share the file system
            env["PEER_ELASTIC_SNAPSHOT_DIR"] = self.workdir / "snapshots"
            env["PEER_ELASTIC_SNAPSHOT_EVERY"] = SNAPSHOT_EVERY_S
        env.update(kwargs.pop("settings", {}))
        super().__init__(plan.seed, list(plan.events), etcd, job, peers=plan.peers,
                         min_np=plan.min_np, max_np=plan.max_np,
                         epochs=epoch_cap(len(plan.events)),
                         progress_timeout_s=progress_timeout_s, **kwargs, **env)
        self.job = job
        self.n_start = plan.peers if plan.start is None else plan.start
        self.paused = False
        self.problems: list[str] = []  # found while running; reported by verify()

    def tag(self) -> str:
        if self.seed < 0:  # a scripted plan (tests/test_contract.py)
            return f"SCRIPTED PLAN [{self.plan.pattern.describe()}]"
        return (f"SCHEDULE SEED {self.seed} [{self.plan.pattern.describe()}] "
                f"(replay: {SEED_ENV}={self.seed} pytest tests/test_schedules.py)")

    def fail(self, msg: str, peers: Any = None, lines: int = 40,
             stacks: bool = False) -> NoReturn:
        super().fail(f"{msg}\nplan: {self.plan.describe()}", peers, lines, stacks)

    def settled(self) -> bool:
        # While paused a joiner waits as a standby although the generation is not full.
        return self.paused or super().settled()

    def standbys(self) -> list[Tracked]:
        return [p for p in self.running() if p.joined_at is not None
                and (p.gen is None or p.gen[0] != self.max_gen)]

    def cli(self, *args: str) -> str:
        cmd = [sys.executable, "-m", "peer_elastic.cli", args[0], "--etcd",
               self.etcd.endpoint_string, "--job", self.job, "--timeout", "30", *args[1:]]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env,
                               cwd=ROOT)
        except subprocess.TimeoutExpired:
            self.fail(f"{' '.join(args)}: peer-elastic did not return in 90 s")
        if r.returncode != 0:
            self.fail(f"peer-elastic {' '.join(args)} exited {r.returncode}: "
                      f"{r.stdout.strip()} {r.stderr.strip()[-800:]}")
        return r.stdout.strip()

    # -- the new kinds ------------------------------------------------------------------------

    def _pick(self, ev: Event, a: Applied) -> tuple[Tracked, bool]:
        target = getattr(ev, "target", "")
        if not target:
            return super()._pick(ev, a)

        def cands() -> list[Tracked]:
            return [p for p in self.roster() if p in self.candidates() and p.gen is not None
                    and (p.gen[1] == 0) == (target == "leader")]

        self.wait_for(f"a {target} roster member", lambda: bool(cands()), timeout=120)
        c = cands()
        p = c[min(int(ev.pick * len(c)), len(c) - 1)]
        a.target, a.role = f"{p.name}/pid {p.pid}", target
        return p, True

    def _do_train(self, ev: Event, a: Applied) -> None:
        assert isinstance(ev, SEvent)
        self.wait_progress(ev.describe(), steps=ev.value)

    def _do_set_max(self, ev: Event, a: Applied) -> None:
        assert isinstance(ev, SEvent)
        g0, size = self.max_gen, self.gen_sizes.get(self.max_gen, 0)
        waiting = len(self.standbys())
        a.detail = self.cli("set", f"max_np={ev.value}")
        self.max_np = ev.value
        # Down below the roster: a new, smaller generation parks members as standbys. Up
        # with standbys waiting (and not paused): a new generation takes them back.
        if size > ev.value or (size < ev.value and waiting and not self.paused):
            a.role = "parks" if size > ev.value else "unparks"
            self.wait_progress(ev.describe(), above_gen=g0)
        else:
            self.wait_progress(ev.describe())

    def _do_set_min(self, ev: Event, a: Applied) -> None:
        assert isinstance(ev, SEvent)
        a.detail = self.cli("set", f"min_np={ev.value}")
        self.min_np = ev.value
        self.wait_progress(ev.describe())

    def _do_pause(self, ev: Event, a: Applied) -> None:
        a.detail = self.cli("pause")
        self.paused = True
        self.wait_progress(ev.describe())

    def _do_resume(self, ev: Event, a: Applied) -> None:
        g0 = self.max_gen
        room = self.gen_sizes.get(g0, 0) < self.max_np
        waiting = len(self.standbys())
        a.detail = self.cli("resume")
        self.paused = False
        if waiting and room:
            a.role = "admits"
            self.wait_progress(ev.describe(), above_gen=g0)
        else:
            self.wait_progress(ev.describe())

    def _do_drain(self, ev: Event, a: Applied) -> None:
        p, in_roster = self._pick(ev, a)
        self.wait_for(f"{p.name} to register", lambda: bool(p.members), timeout=120, peers=[p])

        def drain() -> None:
            a.detail = self.cli("drain", p.members[-1])  # its current registration

        self._leave_gracefully(ev, a, p, in_roster, "drain", drain)

    def _do_stop_short(self, ev: Event, a: Applied) -> None:
        self.wait_for("a peer to stop", lambda: len(self.candidates()) >= 1, timeout=120)
        cands = self.candidates()
        p = cands[min(int(ev.pick * len(cands)), len(cands) - 1)]
        a.target = f"{p.name}/pid {p.pid}"
        a.role = "roster" if p in self.roster() else "standby"
        g0, regs = self.max_gen, len(p.members)
        with self.held(p, getattr(ev, "whole_host", False)) as held:
            time.sleep(ev.hold_s)  # the event itself: how long it stays away
        how = held.how
        self.wait_progress(ev.describe())
        a.detail = (f"{how}, back after {ev.hold_s:.1f}s (join timeout {JOIN_TIMEOUT_S}s); "
                    f"generation {g0} -> {self.max_gen}, re-registered {len(p.members) > regs}")

    def _do_stop_mid(self, ev: Event, a: Applied) -> None:
        self._do_stop_short(ev, a)  # only the hold differs (make_plan draws it)

    def _do_etcd_all(self, ev: Event, a: Applied) -> None:
        assert isinstance(ev, SEvent)
        if not ev.kill_during:
            super()._do_etcd_all(ev, a)
            return

        # The survivors see the collective fail at once but can write no generation: they
        # re-form without the dead peer only once etcd is back (its lease renewed there
        # meanwhile: their evidence and join_timeout, not its TTL, must drop it).
        def kill_one() -> int | None:
            p, in_roster = self._pick(ev, a)
            g0 = self.max_gen
            self._sigkill(p)
            a.detail = f"{a.target} SIGKILLed halfway through the etcd outage"
            return g0 if in_roster else None  # as after any kill (_settle_after_departure)

        self._etcd_outage(ev, a, list(range(self.etcd.size)), midway=kill_one)

    def _do_hang(self, ev: Event, a: Applied) -> None:
        self.wait_for("a roster peer to hang", lambda: any(
            p in self.candidates() for p in self.roster()), timeout=120)
        cands = [p for p in self.roster() if p in self.candidates()]
        p = cands[min(int(ev.pick * len(cands)), len(cands) - 1)]
        a.target, a.role = f"{p.name}/pid {p.pid}", "roster"
        g0 = self.max_gen
        with open(self.hang_file, "a") as f:
            f.write(f"{p.pid}\n")
        n0 = len(p.proc.lines)
        if not self.wait_for(f"{p.name} to hang", lambda: any(
                line.startswith("HANGING ") for line in p.proc.lines[n0:]), timeout=60, peers=[p]):
            return
        p.state = "hung"
        hung_at = time.monotonic()
        bound = HANG_TIMEOUT_S + 10.0
        self.wait_for(f"progress after {ev.describe()}",
                      lambda: self.max_gen > g0 and any(
                          t >= hung_at for t in self.gen_steps.get(self.max_gen, [])),
                      timeout=bound + 60.0)
        first = min(t for t in self.gen_steps[self.max_gen] if t >= hung_at) - hung_at
        a.detail = f"others stepped again {first:.1f}s after the hang (bound {bound:.0f}s)"
        if first > bound:
            self.problems.append(f"{ev.describe()}: the others stepped again only {first:.1f}s "
                                 f"after the hang, over hang_timeout_s + 10 s = {bound:.0f}s")
        self.wait_progress(ev.describe())

    def _do_restart(self, ev: Event, a: Applied) -> None:
        """Every running peer SIGKILLed at once (a preemption of the whole job), then as
        many started again: the group they form holds no state and resumes from the newest
        durable snapshot (plans with ``Pattern.snapshots`` only). Variants: see the module
        docstring."""
        variant = ev.variant if isinstance(ev, SEvent) else ""
        directory = SnapshotDir(self.workdir / "snapshots", self.job)
        g0 = self.max_gen
        if variant == "park":
            size = len(self.roster())
            at_park = directory.newest_valid()
            self.cli("set", f"max_np={size - 1}")
            restore_max, self.max_np = self.max_np, size - 1
            self.wait_progress(f"{ev.describe()}: park one", above_gen=g0)
            g0 = self.max_gen
            self.wait_for("a snapshot after the park", lambda: _newer(
                directory.newest_valid(), at_park), timeout=120)
            gone = self.roster()  # the parked standby lives on, its state behind
        else:
            gone = self.running()
        marks = {p.name: len(p.proc.lines) for p in self.running()}
        for p in gone:
            p.state = "killed"
            p.proc.signal(signal.SIGKILL)
        for p in gone:
            p.proc.proc.wait(timeout=30)
        a.target, a.role = f"all {len(gone)} roster peers" if variant == "park" else \
            f"all {len(gone)} running peers", "everyone"
        newest = directory.newest_valid()
        hidden: Path | None = None
        if variant == "lower" and newest is not None and len(directory.names()) >= 2:
            hidden = directory.path / f"hidden-{newest.id.name}"
            os.rename(directory.snapshot_path(newest.id), hidden)
            newest = directory.newest_valid()
        if variant == "park":
            self.max_np = restore_max
            self.cli("set", f"max_np={self.max_np}")
        env: dict[str, object] = {}
        if variant == "slow":
            env["WORKER_SLOW_RESUME_S"] = COLLECTIVE_TIMEOUT_S + SLOW_RESUME_EXTRA_S
        for _ in gone:
            self.spawn(**env)
        self.wait_for("the restarted peers to register", lambda: all(
            p.joined_at is not None for p in self.running()), timeout=120)
        self.wait_progress(ev.describe(), above_gen=g0)
        if newest is not None:
            first = [int(s[2]) for p in self.running()
                     if (s := _first_start(p, marks.get(p.name, 0))) is not None]
            if first and min(first) < newest.id.commits:
                self.problems.append(f"{ev.describe()}: the job went on from {min(first)} "
                                     f"commits, behind the newest snapshot {newest.id.name}")
        if hidden is not None:
            kept = directory.newest_valid()
            self.wait_for("a snapshot of the restarted lineage", lambda: _newer(
                directory.newest_valid(), kept), timeout=120)
            os.rename(hidden, directory.path / hidden.name[len("hidden-"):])

    # -- the end ----------------------------------------------------------------------------------

    def finish(self, timeout: float = 180.0) -> dict[str, Any]:
        """End the job (WORKER_END_FILE) and wait for every peer; rank 0's RESULT."""
        self.schedule_end_epoch = self.last_epoch
        self.end_file.touch()
        self.say(f"schedule done ({len(self.applied)} events) at epoch {self.last_epoch}: "
                 "ending the job")
        self.wait_for("the job to finish (RESULT)", lambda: self.finished, timeout=timeout)
        for p in self.peers:
            if p.state == "hung" and p.proc.proc.poll() is None:
                p.proc.kill()  # fenced but alive (the library may also exit it): ours to end
        return self.wait_all_exited()

    def verify(self, result: dict[str, Any]) -> list[str]:
        problems = super().verify(result) + self.problems
        if self.plan.pattern.plain and not result.get("plain_ok"):
            problems.append(f"plain values inconsistent with the model: steps "
                            f"{result.get('steps')}, samples {result.get('samples')}, the "
                            f"model's count {result.get('sum')}")
        for p in self.peers if self.plan.pattern.forks else ():
            with p.proc.cond:
                alive = [line for line in p.proc.lines
                         if line.startswith("HELPER ") and line.endswith(" alive")]
            if alive:
                problems.append(f"{p.name}: a forked helper lived on after its terminate() "
                                f"({alive[0]})")
        return problems

    def tails(self, lines: int = 25) -> str:
        """The last lines (STEP lines but the last left out) of every peer's output."""
        parts = []
        for p in self.peers:
            tail = p.tail(lines)
            parts.append(f"--- {p.name} (pid {p.pid}, {p.state}, rc {p.proc.proc.poll()}, "
                         f"members {p.members}):")
            parts.extend(tail)
        return "\n".join(parts)


@dataclass
class Outcome:
    plan: Plan
    runner: ScheduleRunner
    result: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def report(self) -> str:
        """Everything needed to replay and diagnose: seed, pattern, schedule, what happened,
        the problems and each peer's log tail."""
        r = self.runner
        return "\n".join([
            f"{r.tag()}: {'PASSED' if self.passed else 'FAILED'}",
            f"plan: {self.plan.describe()}",
            "events applied:", r.history(),
            f"result: {self.result}",
            *(f"PROBLEM: {p}" for p in self.problems),
            *([r.tails()] if self.problems else []),
        ])


def run_plan(etcd: EtcdCluster, job: str, plan: Plan, workdir: str | os.PathLike[str], *,
             out: Any = print, log_dir: str | os.PathLike[str] | None = None,
             **kwargs: Any) -> Outcome:
    """Start, apply, finish, verify. A failure along the way (a ChaosFailure, or anything
    else) becomes a problem of the outcome, so the caller always gets the report."""
    out(f"SCHEDULE {plan.describe()}")
    runner = ScheduleRunner(plan, etcd, job, workdir, out=out, **kwargs)
    oc = Outcome(plan, runner)
    try:
        runner.start()
        runner.run()
        oc.result = runner.finish()
        oc.problems = runner.verify(oc.result)
    except ChaosFailure as exc:
        oc.problems = [str(exc)]
    except Exception as exc:  # a runner bug or an etcd failure: still name the seed
        oc.problems = [f"{runner.tag()}: {exc!r}"]
    finally:
        with_summary = runner.summary()
        out(with_summary)
        if log_dir is not None:
            out(f"SCHEDULE SEED {plan.seed}: peer and etcd logs in {runner.dump(log_dir)}")
        runner.close()
    counts = Counter(a.event.kind for a in runner.applied)
    out(f"SCHEDULE SEED {plan.seed}: {'PASSED' if oc.passed else 'FAILED'}; applied "
        f"{dict(counts)}; result {oc.result}")
    return oc
