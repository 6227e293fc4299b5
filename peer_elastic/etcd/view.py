"""A decoded, validated picture of one job, kept current by a watch.

:class:`JobView` watches ``/peer-elastic/<job>/`` and turns keys into records. Consumers read
immutable :class:`ViewSnapshot` objects (one per applied revision) and wait on
:meth:`JobView.wait_change`. One view may serve many members in one process (the
membership benchmark simulates hundreds of members in a few processes this way).

Malformed or foreign values are reported once per key and otherwise ignored: a bad record
never crashes the watcher and never becomes part of the picture.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from peer_elastic.errors import RecordError
from peer_elastic.etcd.client import EtcdClient, KeyValue, WatchEvent
from peer_elastic.etcd.keys import KeyKind, ParsedKey, job_prefix, parse
from peer_elastic.etcd.reach import cut_off
from peer_elastic.etcd.watch import PrefixWatch
from peer_elastic.records import (
    AckRecord,
    DoneRecord,
    DrainRecord,
    FenceRecord,
    GenerationRecord,
    HostRecord,
    MemberRecord,
    PaceRecord,
    ProgressRecord,
    ReachRecord,
    RunRecord,
    StateRecord,
    decode,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class WakeOn(enum.Enum):
    """Which changes wake a :meth:`JobView.wait_change` waiter."""

    #: Every new picture.
    ANY_CHANGE = "any change"
    #: What a member that does not write generations must react to: the run, the
    #: generation and its breaks, departures, drains, fences, the blacklist, reachability
    #: reports, ``done``, a reconnection. Not acknowledgements, new registrations, events,
    #: progress or state: those matter to the writer only (a new member is the youngest, so
    #: it never changes who writes). One view may serve hundreds of members of one process;
    #: waking all of their threads for every ack of every member took the CPU from
    #: everything else the process had to do, its lease keep-alives first.
    FOLLOWER_CHANGE = "follower change"


#: Key kinds whose *puts* wake only :attr:`WakeOn.ANY_CHANGE` waiters (see there).
_WRITER_ONLY_PUTS = frozenset({
    KeyKind.MEMBER, KeyKind.READY, KeyKind.ALIVE, KeyKind.STORE, KeyKind.ARRIVED,
    KeyKind.FAILURES, KeyKind.PROGRESS, KeyKind.STATE, KeyKind.PACE, KeyKind.EVENT,
    KeyKind.SNAPSHOT,
})
#: Key kinds whose *deletes* wake only :attr:`WakeOn.ANY_CHANGE` waiters: an expired
#: member's acks go with its member key, whose delete wakes everyone.
_WRITER_ONLY_DELETES = frozenset({
    KeyKind.READY, KeyKind.ALIVE, KeyKind.STORE, KeyKind.ARRIVED, KeyKind.FAILURES,
    KeyKind.PROGRESS, KeyKind.STATE, KeyKind.PACE, KeyKind.EVENT, KeyKind.SNAPSHOT,
})


def wakes_followers(kind: KeyKind | None, deleted: bool) -> bool:
    """Whether a put (or delete) of a key of ``kind`` concerns :attr:`WakeOn.FOLLOWER_CHANGE`
    waiters; an unparsable key (None) does not."""
    if kind is None:
        return False
    return kind not in (_WRITER_ONLY_DELETES if deleted else _WRITER_ONLY_PUTS)


@dataclass(frozen=True)
class Member:
    """A live member: its record plus the etcd facts that matter (age, lease).

    ``id`` and ``host`` are copied out of the protobuf record: they are read on every view
    change by every member, and protobuf field access is slow by comparison.
    """

    record: MemberRecord
    create_revision: int
    lease: int
    id: str = ""
    host: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.record.member_id)
        object.__setattr__(self, "host", self.record.host)


@dataclass(frozen=True)
class Departure:
    """A member key that went away: ``graceful`` when the member was drained first."""

    seq: int
    member_id: str
    host: str
    graceful: bool


@dataclass
class _RunState:
    members: dict[str, Member] = field(default_factory=dict)
    generation: GenerationRecord | None = None
    generation_mod_revision: int = 0
    ready: dict[int, set[str]] = field(default_factory=dict)
    alive: dict[int, set[str]] = field(default_factory=dict)
    broken: dict[int, dict[str, str]] = field(default_factory=dict)
    drains: set[str] = field(default_factory=set)
    fenced: dict[str, FenceRecord] = field(default_factory=dict)
    unreachable: dict[str, frozenset[str]] = field(default_factory=dict)  # ReachRecords
    blacklist: dict[str, HostRecord] = field(default_factory=dict)
    failures: dict[str, tuple[HostRecord, int]] = field(default_factory=dict)
    progress: ProgressRecord | None = None
    state: StateRecord | None = None
    pace: PaceRecord | None = None
    done: DoneRecord | None = None
    events: set[str] = field(default_factory=set)  # keys only: the log is not decoded here
    acks_arrived_at: dict[int, float] = field(default_factory=dict)  # see ViewSnapshot


@dataclass(frozen=True)
class ViewSnapshot:
    """The job as of one revision. Treat every field as read-only."""

    revision: int
    version: int
    run: RunRecord | None
    run_mod_revision: int
    members: Mapping[str, Member]
    by_age: tuple[Member, ...]
    generation: GenerationRecord | None
    generation_mod_revision: int
    ready: Mapping[int, frozenset[str]]
    broken: Mapping[int, Mapping[str, str]]
    drains: frozenset[str]
    blacklist: Mapping[str, HostRecord]
    failures: Mapping[str, tuple[HostRecord, int]]
    progress: ProgressRecord | None
    done: DoneRecord | None
    membership_changed_at: float  # time.monotonic() of the last join or leave
    departures: tuple[Departure, ...]  # recent leaves, oldest first
    alive: Mapping[int, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))
    connected_at: float = 0.0  # time.monotonic() when the watch last (re)connected
    event_count: int = 0  # keys under events/ (the leader prunes the oldest beyond a cap)
    # Members that took themselves out (a hung training thread): never eligible again.
    fenced: Mapping[str, FenceRecord] = field(default_factory=lambda: MappingProxyType({}))
    # Reporter -> the members whose process-group address it cannot reach (etcd/reach.py).
    unreachable: Mapping[str, frozenset[str]] = field(
        default_factory=lambda: MappingProxyType({}))
    # That the run's training state has commits (rank 0 writes it; elastic.py reads it when a
    # group forms with no rank holding committed state).
    state: StateRecord | None = None
    # Generation -> time.monotonic() when this view last applied a new ``ready`` or
    # ``alive`` ack for it (the leader's silence clock waits while acks keep arriving).
    acks_arrived_at: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    # Every roster member's pace as the group last exchanged it (rank 0 writes it; status and
    # the dashboard show it: peer_elastic.straggler).
    pace: PaceRecord | None = None

    @property
    def generation_number(self) -> int:
        return self.generation.number if self.generation is not None else 0

    def roster_ids(self) -> frozenset[str]:
        """The current generation's roster as a set (empty without a generation).

        Computed once per snapshot: every member of a process asks "am I listed" on every
        change, and a membership test on the protobuf list costs O(roster).
        """
        cached = self.__dict__.get("_roster_ids")
        if cached is None:
            cached = frozenset(self.generation.roster) if self.generation is not None \
                else frozenset()
            object.__setattr__(self, "_roster_ids", cached)
        return cached

    def ready_for(self, n: int) -> frozenset[str]:
        return self.ready.get(n, frozenset())

    def alive_for(self, n: int) -> frozenset[str]:
        """Members whose coordination thread answered "alive" after ``n`` broke."""
        return self.alive.get(n, frozenset())

    def cut_off(self) -> frozenset[str]:
        """Live members left out of rosters because the others' process groups cannot
        reach them, or they cannot reach the others (:func:`peer_elastic.etcd.reach.cut_off`
        of the reports). Computed once per snapshot."""
        cached = self.__dict__.get("_cut_off")
        if cached is None:
            roster = self.generation.roster if self.generation is not None else ()
            cached = cut_off(self.unreachable, [m.id for m in self.by_age], roster) \
                if self.unreachable else frozenset()
            object.__setattr__(self, "_cut_off", cached)
        return cached

    def eligible(self) -> list[Member]:
        """Members, oldest first, that may be in a roster: not drained, not fenced, host not
        blacklisted, not cut off from the others (:meth:`cut_off`). A copy; see
        :meth:`eligible_members`."""
        return list(self.eligible_members())

    def eligible_members(self) -> tuple[Member, ...]:
        """:meth:`eligible`, computed once per snapshot and shared: many members of one
        process read the same snapshot on every change, and an O(members) copy each made
        that quadratic."""
        return self._memo("_eligible", lambda: tuple(
            m for m in self.by_age
            if m.id not in self.drains and m.id not in self.fenced
            and m.host not in self.blacklist and m.id not in self.cut_off()))

    def eligible_rank(self, member_id: str) -> int | None:
        """Position of ``member_id`` in :meth:`eligible_members` (0: the oldest), or None."""
        ranks = self._memo("_eligible_rank", lambda: {
            m.id: k for k, m in enumerate(self.eligible_members())})
        return ranks.get(member_id)

    def not_ready(self) -> tuple[str, ...]:
        """Roster members of the current generation with a live key and no ``ready`` ack,
        in roster order. Once per snapshot."""
        def compute() -> tuple[str, ...]:
            gen = self.generation
            if gen is None:
                return ()
            ready = self.ready_for(gen.number)
            return tuple(m for m in gen.roster if m not in ready and m in self.members)
        return self._memo("_not_ready", compute)

    def not_alive(self) -> tuple[str, ...]:
        """Once the current generation broke: roster members with a live key that neither
        answered ``alive`` nor marked it broken themselves, in roster order (empty while it
        is not broken). Once per snapshot."""
        def compute() -> tuple[str, ...]:
            gen = self.generation
            broken = self.broken.get(gen.number, {}) if gen is not None else {}
            if not broken:
                return ()
            alive = self.alive_for(gen.number)  # type: ignore[union-attr]
            return tuple(m for m in gen.roster  # type: ignore[union-attr]
                         if m not in alive and m not in broken and m in self.members)
        return self._memo("_not_alive", compute)

    def roster_lacks_ready(self) -> bool:
        """Whether a roster member of the current generation has no ``ready`` ack, its key
        live or gone (unlike :meth:`not_ready`). Once per snapshot: every follower of a
        process asks on every wake, and the set difference costs O(roster)."""
        return self._memo("_roster_lacks_ready", lambda: self.generation is not None
                          and not self.roster_ids() <= self.ready_for(self.generation.number))

    def roster_lacks_alive(self) -> bool:
        """Whether a roster member of the current generation has no ``alive`` ack, its key
        live or gone, whether or not it marked the generation broken itself (unlike
        :meth:`not_alive`). Once per snapshot, as :meth:`roster_lacks_ready`."""
        return self._memo("_roster_lacks_alive", lambda: self.generation is not None
                          and not self.roster_ids() <= self.alive_for(self.generation.number))

    def owing_acks(self) -> frozenset[str]:
        """:meth:`not_ready` and :meth:`not_alive` together: who owes an ack now."""
        return self._memo("_owing", lambda: frozenset(self.not_ready()) | frozenset(
            self.not_alive()))

    def _memo(self, name: str, compute: Callable[[], _T]) -> _T:
        """``compute()``, once per snapshot (it is immutable; the cache is not a field)."""
        cached = self.__dict__.get(name)
        if cached is None:
            cached = compute()
            object.__setattr__(self, name, cached)
        return cached


class JobView:
    """Watches one job and keeps a :class:`ViewSnapshot` of its current run."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.client = client
        self.job = job
        self.prefix = job_prefix(job)
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)  # every change (WakeOn.ANY_CHANGE)
        self._followers = threading.Condition(mutex)  # WakeOn.FOLLOWER_CHANGE only
        self._run: RunRecord | None = None
        self._run_mod_revision = 0
        self._runs: dict[str, _RunState] = {}
        self._revision = 0
        self._version = 0
        self._follower_version = 0
        self._membership_changed_at = time.monotonic()
        self._snapshot: ViewSnapshot | None = None
        self._reported: set[str] = set()
        self._departures: list[Departure] = []
        self._departure_seq = 0
        self.malformed: dict[str, str] = {}
        self._watch = PrefixWatch(client, self.prefix, self._apply_snapshot, self._apply_events,
                                  on_connected=self._on_connected)
        self._started = False
        self._users = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> JobView:
        with self._lock:
            self._users += 1
            if self._started:
                return self
            self._started = True
        try:
            self._watch.start()  # its first read can fail (etcd unreachable)
        except BaseException:
            with self._lock:  # not started: a later start() must try again
                self._started = False
                self._users -= 1
            raise
        return self

    def stop(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
        self._watch.stop()

    @property
    def watch(self) -> PrefixWatch:
        return self._watch

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self) -> ViewSnapshot:
        # Without the lock while one is built: a snapshot is immutable, and one read just
        # before a change commits is the one the lock would have given just before it. The
        # reset vote asks on every optimizer step.
        snap = self._snapshot
        if snap is not None:
            return snap
        with self._lock:
            if self._snapshot is None:
                self._snapshot = self._build_snapshot()
            return self._snapshot

    def wait_change(self, version: int, timeout: float,
                    until: Callable[[], bool] | None = None,
                    wake_on: WakeOn = WakeOn.ANY_CHANGE) -> int:
        """Block until the view's version of the changes ``wake_on`` names differs from
        ``version``, ``until()`` holds (checked at every :meth:`wake`), or ``timeout``
        passes. Returns that version now (a :attr:`WakeOn.FOLLOWER_CHANGE` version is not a
        snapshot's ``version``: pass each kind its own)."""
        if wake_on is WakeOn.ANY_CHANGE:
            cond, current = self._lock, lambda: self._version
        else:
            cond, current = self._followers, lambda: self._follower_version
        with cond:
            cond.wait_for(lambda: current() != version or (until is not None and until()),
                          timeout=timeout)
            return current()

    def wake(self) -> None:
        """Wake every waiter so it re-checks its own condition (close, lease loss)."""
        with self._lock:
            self._lock.notify_all()
            self._followers.notify_all()

    def wait_for(self, predicate, timeout: float) -> ViewSnapshot | None:  # noqa: ANN001
        """Wait until ``predicate(snapshot)`` holds; return that snapshot or None on timeout."""
        deadline = time.monotonic() + timeout
        version = -1
        while True:
            snap = self.snapshot()
            if snap.version != version and predicate(snap):
                return snap
            version = snap.version
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.wait_change(version, left)

    # -- applying watch data -------------------------------------------------------------------

    def _apply_snapshot(self, kvs: list[KeyValue], revision: int) -> None:
        with self._lock:
            old_members = set(self._current().members) if self._run else set()
            self._run = None
            self._run_mod_revision = 0
            self._runs = {}
            for kv in kvs:
                self._apply_put(kv)
            new_members = set(self._current().members) if self._run else set()
            if old_members != new_members:
                self._membership_changed_at = time.monotonic()
            self._commit(revision, followers=True)

    def _apply_events(self, events: list[WatchEvent], revision: int) -> None:
        with self._lock:
            followers = False
            for ev in events:
                deleted = ev.kind != "put"
                k = self._apply_delete(ev.kv.key) if deleted else self._apply_put(ev.kv)
                followers = followers or wakes_followers(k.kind if k else None, deleted)
            self._commit(revision, followers)

    def _on_connected(self) -> None:
        # A (re)connection changes the picture's freshness (connected_at): publish it.
        with self._lock:
            self._commit(self._revision, followers=True)

    def _commit(self, revision: int, followers: bool) -> None:
        self._revision = revision
        self._version += 1
        self._snapshot = None
        self._lock.notify_all()
        if followers:
            self._follower_version += 1
            self._followers.notify_all()

    def _current(self) -> _RunState:
        assert self._run is not None
        return self._runs.setdefault(self._run.run_id, _RunState())

    def _bad(self, key: str, why: str) -> None:
        self.malformed[key] = why
        if key not in self._reported:
            self._reported.add(key)
            log.warning("ignoring malformed record: %s", why)

    def _parse(self, key: str) -> ParsedKey | None:
        k = parse(key)
        return k if k is not None and k.job == self.job else None

    def _apply_put(self, kv: KeyValue) -> ParsedKey | None:
        """Apply one put; returns the key it parsed (None: not one of ours)."""
        k = self._parse(kv.key)
        if k is None:
            self._bad(kv.key, f"{kv.key}: unexpected key under the job prefix")
            return None
        if k.kind is KeyKind.SNAPSHOT:
            return k  # job-level durable snapshot records: not part of any run's picture
        try:
            if k.kind is KeyKind.RUN:
                run = decode(RunRecord, kv.value, kv.key)
                if self._run is None or self._run.run_id != run.run_id:
                    self._runs = {run.run_id: self._runs.get(run.run_id, _RunState())}
                    self._membership_changed_at = time.monotonic()
                self._run = run
                self._run_mod_revision = kv.mod_revision
                return k
            st = self._runs.setdefault(k.run_id, _RunState())
            if k.kind is KeyKind.GENERATION:
                # Track the key's revision even if the value turns out to be junk, so the
                # leader's compare-and-swap can replace a corrupted record.
                st.generation_mod_revision = kv.mod_revision
            self._apply_run_put(st, k, kv)
        except RecordError as exc:
            self._bad(kv.key, str(exc))
            return k
        self.malformed.pop(kv.key, None)
        return k

    def _apply_run_put(self, st: _RunState, k: ParsedKey, kv: KeyValue) -> None:
        kind, name = k.kind, k.name
        if kind is KeyKind.MEMBER:
            rec = decode(MemberRecord, kv.value, kv.key)
            if rec.member_id != name:
                raise RecordError(f"{kv.key}: member id {rec.member_id!r} does not match its key")
            if name not in st.members:
                self._membership_changed_at = time.monotonic()
            st.members[name] = Member(rec, kv.create_revision, kv.lease)
        elif kind is KeyKind.GENERATION:
            rec = decode(GenerationRecord, kv.value, kv.key)
            if st.generation is not None and rec.number <= st.generation.number:
                raise RecordError(
                    f"{kv.key}: generation went from {st.generation.number} to {rec.number}"
                )
            st.generation = rec
            # Acks of generations two or more behind are history.
            for table in (st.ready, st.alive, st.broken, st.acks_arrived_at):
                for n in [n for n in table if n < rec.number - 1]:
                    del table[n]
        elif kind in (KeyKind.READY, KeyKind.ALIVE, KeyKind.BROKEN):
            ack = decode(AckRecord, kv.value, kv.key)
            if kind is KeyKind.READY:
                st.ready.setdefault(k.generation, set()).add(name)
                st.acks_arrived_at[k.generation] = time.monotonic()
            elif kind is KeyKind.ALIVE:
                st.alive.setdefault(k.generation, set()).add(name)
                st.acks_arrived_at[k.generation] = time.monotonic()
            else:
                st.broken.setdefault(k.generation, {})[name] = ack.detail
        elif kind in (KeyKind.STORE, KeyKind.ARRIVED):
            return  # a rendezvous' traffic: not part of the picture
        elif kind is KeyKind.DRAIN:
            decode(DrainRecord, kv.value, kv.key)
            if name not in st.drains:
                self._membership_changed_at = time.monotonic()  # eligibility changed
            st.drains.add(name)
        elif kind is KeyKind.FENCED:
            fence = decode(FenceRecord, kv.value, kv.key)
            if fence.member_id != name:
                raise RecordError(f"{kv.key}: member id {fence.member_id!r} does not match its key")
            if name not in st.fenced:
                self._membership_changed_at = time.monotonic()  # eligibility changed
            st.fenced[name] = fence
        elif kind is KeyKind.UNREACHABLE:
            reach = decode(ReachRecord, kv.value, kv.key)
            if reach.member_id != name:
                raise RecordError(f"{kv.key}: member id {reach.member_id!r} does not match its key")
            seen = frozenset(reach.unreachable)
            if st.unreachable.get(name) != seen:
                self._membership_changed_at = time.monotonic()  # eligibility may change
            st.unreachable[name] = seen
        elif kind is KeyKind.BLACKLIST:
            if name not in st.blacklist:
                self._membership_changed_at = time.monotonic()
            st.blacklist[name] = decode(HostRecord, kv.value, kv.key)
        elif kind is KeyKind.FAILURES:
            st.failures[name] = (decode(HostRecord, kv.value, kv.key), kv.mod_revision)
        elif kind is KeyKind.PROGRESS:
            st.progress = decode(ProgressRecord, kv.value, kv.key)
        elif kind is KeyKind.STATE:
            st.state = decode(StateRecord, kv.value, kv.key)
        elif kind is KeyKind.PACE:
            st.pace = decode(PaceRecord, kv.value, kv.key)
        elif kind is KeyKind.DONE:
            st.done = decode(DoneRecord, kv.value, kv.key)
        elif kind is KeyKind.EVENT:
            st.events.add(kv.key)  # counted for pruning; records are read by the CLI only

    def _apply_delete(self, key: str) -> ParsedKey | None:
        """Apply one delete; returns the key it parsed (None: not one of ours)."""
        self.malformed.pop(key, None)
        k = self._parse(key)
        if k is not None:
            self._apply_parsed_delete(key, k)
        return k

    def _apply_parsed_delete(self, key: str, k: ParsedKey) -> None:
        if k.kind is KeyKind.RUN:
            self._run = None
            self._run_mod_revision = 0
            return
        st = self._runs.get(k.run_id)
        if st is None:
            return
        kind, name = k.kind, k.name
        if kind is KeyKind.MEMBER:
            m = st.members.pop(name, None)
            if m is not None:
                self._membership_changed_at = time.monotonic()
                if self._run is not None and k.run_id == self._run.run_id:
                    self._departure_seq += 1
                    self._departures.append(
                        Departure(self._departure_seq, m.id, m.host, m.id in st.drains))
                    del self._departures[:-256]
        elif kind is KeyKind.GENERATION:
            st.generation = None  # only when the run lease ends
            st.generation_mod_revision = 0
        elif kind is KeyKind.READY:
            st.ready.get(k.generation, set()).discard(name)
        elif kind is KeyKind.ALIVE:
            st.alive.get(k.generation, set()).discard(name)
        elif kind is KeyKind.BROKEN:
            st.broken.get(k.generation, {}).pop(name, None)
        elif kind is KeyKind.DRAIN:
            st.drains.discard(name)
        elif kind is KeyKind.FENCED:
            st.fenced.pop(name, None)
        elif kind is KeyKind.UNREACHABLE:
            if st.unreachable.pop(name, None) is not None:
                self._membership_changed_at = time.monotonic()  # eligibility may change
        elif kind is KeyKind.BLACKLIST:
            if st.blacklist.pop(name, None) is not None:
                self._membership_changed_at = time.monotonic()  # the host is eligible again
        elif kind is KeyKind.FAILURES:
            st.failures.pop(name, None)
        elif kind is KeyKind.EVENT:
            st.events.discard(key)
        elif kind is KeyKind.PROGRESS:
            st.progress = None
        elif kind is KeyKind.STATE:
            st.state = None
        elif kind is KeyKind.PACE:
            st.pace = None
        elif kind is KeyKind.DONE:
            st.done = None

    def _build_snapshot(self) -> ViewSnapshot:
        st = self._runs.get(self._run.run_id) if self._run is not None else None
        st = st or _RunState()
        by_age = tuple(sorted(st.members.values(), key=lambda m: m.create_revision))
        return ViewSnapshot(
            revision=self._revision,
            version=self._version,
            run=self._run,
            run_mod_revision=self._run_mod_revision,
            members=MappingProxyType(dict(st.members)),
            by_age=by_age,
            generation=st.generation,
            generation_mod_revision=st.generation_mod_revision,
            ready=MappingProxyType({n: frozenset(s) for n, s in st.ready.items()}),
            broken=MappingProxyType({n: MappingProxyType(dict(d)) for n, d in st.broken.items()}),
            drains=frozenset(st.drains),
            blacklist=MappingProxyType(dict(st.blacklist)),
            failures=MappingProxyType(dict(st.failures)),
            progress=st.progress,
            done=st.done,
            membership_changed_at=self._membership_changed_at,
            departures=tuple(self._departures),
            alive=MappingProxyType({n: frozenset(s) for n, s in st.alive.items()}),
            connected_at=self._watch.connected_at,
            event_count=len(st.events),
            fenced=MappingProxyType(dict(st.fenced)),
            unreachable=MappingProxyType(dict(st.unreachable)),
            state=st.state,
            acks_arrived_at=MappingProxyType(dict(st.acks_arrived_at)),
            pace=st.pace,
        )

