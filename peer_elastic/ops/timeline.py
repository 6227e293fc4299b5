"""A run's history as typed values: generations, recoveries and progress over time.

Built from what etcd keeps of a run: the event log (``<run>/events/``, every generation
with its world size and typed causes, every join, leave, expiry, drain; rank 0's
"generation formed" event with the recovery's timing breakdown) and the history of the
``progress`` key (kept by etcd until it compacts it). The dashboard and the report render a
:class:`Timeline`; neither reads etcd records themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from peer_elastic.errors import EtcdError, RecordError
from peer_elastic.etcd.admin import current_run
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.proto.records_pb2 import GenerationCause
from peer_elastic.records import EventRecord, ProgressRecord, decode

log = logging.getLogger(__name__)

#: The recovery phases rank 0 records at the first step after a reset, in order:
#: (key in the event's timings, what it measures).
PHASES: tuple[tuple[str, str], ...] = (
    ("detected_to_written", "leader saw the change -> new generation written"),
    ("written_to_formed", "written -> process group formed"),
    ("formed_to_synced", "formed -> state agreed and synced"),
    ("synced_to_first_step", "synced -> first training step"),
)

#: How many versions of the progress key a timeline reads back at most.
MAX_PROGRESS_POINTS = 2000


def cause_name(cause: int) -> str:
    """A generation cause as a short word ("other" for a value this version does not know)."""
    try:
        name = GenerationCause.Name(cause)
    except ValueError:
        return "other"
    return name.removeprefix("GENERATION_CAUSE_").lower()


@dataclass(frozen=True)
class Event:
    """One entry of the run's event log."""

    unix: float
    kind: str
    member_id: str
    generation: int
    detail: str
    timings_s: Mapping[str, float] = field(default_factory=dict)
    world_size: int | None = None  # "generation" events only; None from older writers
    causes: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, rec: EventRecord) -> Event:
        is_gen = rec.kind == "generation"
        return cls(rec.unix, rec.kind, rec.member_id, rec.generation, rec.detail,
                   dict(rec.timings_s),
                   rec.world_size if is_gen and (rec.world_size or rec.causes) else None,
                   tuple(cause_name(c) for c in rec.causes))


@dataclass(frozen=True)
class GenerationPoint:
    """The world size from ``unix`` on, and why it changed then."""

    number: int
    unix: float
    world_size: int | None  # None: written by a peer-elastic too old to record it
    causes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Recovery:
    """Where the time of one reset went. ``phases`` holds each phase of :data:`PHASES`
    (None where the event does not carry it); ``total`` is detected -> first step."""

    generation: int
    unix: float
    phases: tuple[tuple[str, float | None], ...]
    total: float | None


@dataclass(frozen=True)
class ProgressPoint:
    unix: float
    step: int
    epoch: int
    generation: int
    world_size: int


@dataclass(frozen=True)
class Timeline:
    run_id: str
    events: tuple[Event, ...]
    generations: tuple[GenerationPoint, ...]
    recoveries: tuple[Recovery, ...]
    progress: tuple[ProgressPoint, ...]
    progress_complete: bool  # False: etcd no longer holds the earliest progress versions

    def throughput(self) -> list[tuple[float, float]]:
        """(unix, steps per second) between consecutive progress points."""
        out = []
        for a, b in pairwise(self.progress):
            if b.unix > a.unix and b.step >= a.step:
                out.append((b.unix, (b.step - a.step) / (b.unix - a.unix)))
        return out


def build(run_id: str, events: Iterable[Event], progress: Sequence[ProgressPoint] = (),
          progress_complete: bool = True) -> Timeline:
    """A :class:`Timeline` of ``events`` (any order) and ``progress`` (any order)."""
    evs = tuple(sorted(events, key=lambda e: e.unix))
    gens = tuple(GenerationPoint(e.generation, e.unix, e.world_size, e.causes, e.detail)
                 for e in evs if e.kind == "generation")
    recs = []
    for e in evs:
        if e.kind == "generation formed" and e.timings_s:
            recs.append(Recovery(e.generation, e.unix,
                                 tuple((k, e.timings_s.get(k)) for k, _ in PHASES),
                                 e.timings_s.get("total")))
    return Timeline(run_id, evs, gens, tuple(recs),
                    tuple(sorted(progress, key=lambda p: p.unix)), progress_complete)


def read_events(client: EtcdClient, keys: RunKeys) -> list[Event]:
    """The run's event log (records that do not decode are skipped)."""
    kvs, _ = client.get_prefix(keys.events_prefix)
    out = []
    for kv in kvs:
        try:
            out.append(Event.from_record(decode(EventRecord, kv.value, kv.key)))
        except RecordError as exc:
            log.debug("skipping event: %s", exc)
    return out


def read_progress(client: EtcdClient, keys: RunKeys,
                  limit: int = MAX_PROGRESS_POINTS) -> tuple[list[ProgressPoint], bool]:
    """Versions of the progress key, newest first walking back through etcd's history;
    and whether the walk reached the first version (False: compacted, or ``limit`` hit)."""
    out: list[ProgressPoint] = []
    kv = client.get(keys.progress)
    while kv is not None and len(out) < limit:
        try:
            rec = decode(ProgressRecord, kv.value, kv.key)
            out.append(ProgressPoint(rec.unix, rec.step, rec.epoch, rec.generation,
                                     rec.world_size))
        except RecordError as exc:
            log.debug("skipping progress version: %s", exc)
        if kv.version <= 1:
            return out, True
        try:
            kv = client.get_at(keys.progress, kv.mod_revision - 1)
        except EtcdError:  # compacted: what is older is gone
            return out, False
    return out, kv is None


def read_timeline(client: EtcdClient, job: str) -> Timeline:
    """The current run of ``job`` as a :class:`Timeline` (while its keys exist)."""
    run, _ = current_run(client, job)
    keys = RunKeys(job, run.run_id)
    progress, complete = read_progress(client, keys)
    return build(run.run_id, read_events(client, keys), progress, complete)
