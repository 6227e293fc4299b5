"""The key layout of one job in etcd.

```
/peer-elastic/<job>/run                         RunRecord (run lease)
/peer-elastic/<job>/snapshots/<name>            SnapshotRecord (no lease: outlives runs)
/peer-elastic/<job>/<run>/members/<member>      MemberRecord (member lease)
/peer-elastic/<job>/<run>/generation            GenerationRecord (run lease; CAS by the leader)
/peer-elastic/<job>/<run>/gen/<n>/ready/<m>     AckRecord (member lease)
/peer-elastic/<job>/<run>/gen/<n>/broken/<m>    AckRecord (member lease)
/peer-elastic/<job>/<run>/gen/<n>/alive/<m>     AckRecord (member lease): "n broke, I live"
/peer-elastic/<job>/<run>/gen/<n>/arrived/<m>   empty (run lease): m passed n's commit point
/peer-elastic/<job>/<run>/gen/<n>/store/...     torch Store keys (run lease)
/peer-elastic/<job>/<run>/drain/<member>        DrainRecord (run lease)
/peer-elastic/<job>/<run>/fenced/<member>       FenceRecord (own lease): it took itself out
/peer-elastic/<job>/<run>/unreachable/<member>  ReachRecord (member lease): whom it cannot reach
/peer-elastic/<job>/<run>/failures/<host>       HostRecord (run lease)
/peer-elastic/<job>/<run>/blacklist/<host>      HostRecord (cooldown lease)
/peer-elastic/<job>/<run>/progress              ProgressRecord (run lease)
/peer-elastic/<job>/<run>/state                 StateRecord (run lease): the state has commits
/peer-elastic/<job>/<run>/pace                  PaceRecord (run lease): the peers' paces, by rank 0
/peer-elastic/<job>/<run>/events/<ns>-<member>  EventRecord (run lease)
/peer-elastic/<job>/<run>/done                  DoneRecord (run lease)
```

Everything but ``run`` and ``snapshots/`` lives under the run id, and every key is attached to a lease, so a
finished or abandoned run disappears ``run_ttl`` after its last peer and the job name can
be used again without colliding with stale keys.

:class:`JobKeys` builds the job-level keys, :class:`RunKeys` those of one run, and
:func:`parse` is their inverse: it turns a key back into a :class:`ParsedKey`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from peer_elastic.errors import ConfigError
from peer_elastic.records import valid_name

ROOT = "/peer-elastic/"


def job_prefix(job: str) -> str:
    if not valid_name(job):
        raise ConfigError(
            f"invalid job name {job!r}: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return f"{ROOT}{job}/"


@dataclass(frozen=True)
class JobKeys:
    """Keys of one job that do not belong to a run: the prefix and the ``run`` record."""

    job: str

    @property
    def prefix(self) -> str:
        return job_prefix(self.job)

    @property
    def run_key(self) -> str:
        return self.prefix + "run"

    def run(self, run_id: str) -> RunKeys:
        return RunKeys(self.job, run_id)

    @property
    def snapshots_prefix(self) -> str:
        """Durable snapshots' records: job level, since a resumed job is a new run."""
        return self.prefix + "snapshots/"

    def snapshot(self, name: str) -> str:
        return self.snapshots_prefix + name


@dataclass(frozen=True)
class RunKeys:
    """Keys of one run of one job."""

    job: str
    run_id: str

    @property
    def job_keys(self) -> JobKeys:
        return JobKeys(self.job)

    @property
    def job_prefix(self) -> str:
        return job_prefix(self.job)

    @property
    def run_key(self) -> str:
        return self.job_keys.run_key

    @property
    def prefix(self) -> str:
        return f"{self.job_prefix}{self.run_id}/"

    def member(self, member_id: str) -> str:
        return f"{self.prefix}members/{member_id}"

    @property
    def generation(self) -> str:
        return self.prefix + "generation"

    def gen_prefix(self, n: int) -> str:
        return f"{self.prefix}gen/{n}/"

    def ready(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}ready/{member_id}"

    def broken(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}broken/{member_id}"

    def alive(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}alive/{member_id}"

    def arrivals_prefix(self, n: int) -> str:
        """Where the members of generation ``n`` arrive at its rendezvous' commit point
        (:mod:`peer_elastic.torch.barrier`); one key per member id."""
        return f"{self.gen_prefix(n)}arrived/"

    def store_prefix(self, n: int) -> str:
        return f"{self.gen_prefix(n)}store/"

    def drain(self, member_id: str) -> str:
        return f"{self.prefix}drain/{member_id}"

    def fenced(self, member_id: str) -> str:
        return f"{self.prefix}fenced/{member_id}"

    def unreachable(self, member_id: str) -> str:
        return f"{self.prefix}unreachable/{member_id}"

    def failures(self, host: str) -> str:
        return f"{self.prefix}failures/{host}"

    def blacklist(self, host: str) -> str:
        return f"{self.prefix}blacklist/{host}"

    @property
    def progress(self) -> str:
        return self.prefix + "progress"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def done(self) -> str:
        return self.prefix + "done"

    @property
    def pace(self) -> str:
        return self.prefix + "pace"

    def event(self, writer: str, ns: int | None = None) -> str:
        """A new event key. Event keys sort by time: a zero-padded nanosecond stamp (now,
        unless ``ns`` is given), then the writer (a member id, or ``operator``)."""
        return f"{self.prefix}events/{time.time_ns() if ns is None else ns:020d}-{writer}"

    @property
    def events_prefix(self) -> str:
        return self.prefix + "events/"


class KeyKind(enum.Enum):
    """What a key under the job prefix is (see the module docstring)."""

    RUN = "run"
    MEMBER = "members"
    GENERATION = "generation"
    READY = "ready"
    BROKEN = "broken"
    ALIVE = "alive"
    STORE = "store"
    ARRIVED = "arrived"
    DRAIN = "drain"
    FENCED = "fenced"
    UNREACHABLE = "unreachable"
    FAILURES = "failures"
    BLACKLIST = "blacklist"
    PROGRESS = "progress"
    STATE = "state"
    PACE = "pace"
    DONE = "done"
    EVENT = "events"
    SNAPSHOT = "snapshots"


@dataclass(frozen=True)
class ParsedKey:
    """A key taken apart by :func:`parse`.

    ``name`` is the last segment where the key has one: the member id (members, acks,
    drain, fenced, unreachable), the host (failures, blacklist), the event's ``<ns>-<writer>``, or the
    rest of a store key. ``generation`` is set for keys under ``gen/<n>/``.
    """

    kind: KeyKind
    job: str
    run_id: str = ""  # "" for RUN
    name: str = ""
    generation: int = 0


_RUN_SINGLE = {"generation": KeyKind.GENERATION, "progress": KeyKind.PROGRESS,
               "state": KeyKind.STATE, "pace": KeyKind.PACE, "done": KeyKind.DONE}
_RUN_NAMED = {"members": KeyKind.MEMBER, "drain": KeyKind.DRAIN, "fenced": KeyKind.FENCED,
              "unreachable": KeyKind.UNREACHABLE,
              "failures": KeyKind.FAILURES, "blacklist": KeyKind.BLACKLIST,
              "events": KeyKind.EVENT}
_ACKS = {"ready": KeyKind.READY, "broken": KeyKind.BROKEN, "alive": KeyKind.ALIVE}


def parse(key: str) -> ParsedKey | None:
    """The inverse of the builders above: what ``key`` is, or None if no builder makes it."""
    if not key.startswith(ROOT):
        return None
    job, _, rest = key[len(ROOT):].partition("/")
    if not valid_name(job) or not rest:
        return None
    if rest == "run":
        return ParsedKey(KeyKind.RUN, job)
    run_id, _, tail = rest.partition("/")
    if not run_id or not tail:
        return None
    if run_id == "snapshots":  # job level; run ids are "r<time>-<hex>", never this word
        return ParsedKey(KeyKind.SNAPSHOT, job, "", tail) if valid_name(tail) else None
    path = tail.split("/")
    head = path[0]
    if len(path) == 1 and head in _RUN_SINGLE:
        return ParsedKey(_RUN_SINGLE[head], job, run_id)
    if len(path) == 2 and head in _RUN_NAMED and path[1]:
        return ParsedKey(_RUN_NAMED[head], job, run_id, path[1])
    if head == "gen" and len(path) >= 3 and path[1].isdigit():
        n = int(path[1])
        if len(path) == 4 and path[2] in _ACKS and path[3]:
            return ParsedKey(_ACKS[path[2]], job, run_id, path[3], n)
        if len(path) == 4 and path[2] == "arrived" and path[3]:
            return ParsedKey(KeyKind.ARRIVED, job, run_id, path[3], n)
        if path[2] == "store" and len(path) >= 4:
            return ParsedKey(KeyKind.STORE, job, run_id, "/".join(path[3:]), n)
    return None
