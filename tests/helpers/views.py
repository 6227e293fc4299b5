"""Job views built by hand for unit tests of the roster, the leader and death detection:
one :func:`snap` (a :class:`ViewSnapshot`) and the job settings they plan with (:func:`cfg`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from peer_elastic.config import JobSettings
from peer_elastic.etcd.view import Departure, Member, ViewSnapshot
from peer_elastic.records import (
    FenceRecord,
    GenerationRecord,
    HostRecord,
    JobConfig,
    MemberRecord,
    RunRecord,
)


def cfg(**settings: object) -> JobConfig:
    """Resolved job settings: quick settling (tests step fake clocks), ``settings`` on top."""
    return JobSettings(**{"settle_s": 0.05, "start_settle_s": 1.0, **settings}).resolved()


def member(member_id: str, age: int, ports: bool = False) -> Member:
    """Member ``member_id`` (host: the part before ``-``), the ``age``-th to register (0 the
    oldest); with ``ports``, on 127.0.0.1 with probe port 5000 + ``age``."""
    return Member(MemberRecord(member_id=member_id, host=member_id.split("-")[0],
                               lease_id=10 + age, net_address="127.0.0.1" if ports else "",
                               probe_port=5000 + age if ports else 0), age + 1, 1)


def snap(members: Sequence[str], gen: tuple[int, Iterable[str]] | None = None, *,
         ready: Iterable[str] = (), broken: Iterable[str] = (), alive: Iterable[str] = (),
         drains: Iterable[str] = (), blacklist: Iterable[str] = (),
         failures: Mapping[str, tuple[HostRecord, int]] | None = None,
         fenced: Mapping[str, FenceRecord] | None = None, changed_at: float = 0.0,
         departures: Iterable[Departure] = (), event_count: int = 0, ports: bool = False,
         **settings: object) -> ViewSnapshot:
    """The job with ``members`` live (oldest first) and generation ``gen`` = (number,
    roster) if given; ``ready``, ``broken`` and ``alive`` are acks for that generation,
    ``blacklist`` hosts, ``fenced`` members (never eligible), and the run's config
    :func:`cfg` of ``settings``. ``ports``: members have probe ports (:func:`member`)."""
    config = cfg(**settings)
    run = RunRecord(run_id="r", lease_id=1)
    run.config.CopyFrom(config)
    ms = {m: member(m, i, ports) for i, m in enumerate(members)}
    g = None if gen is None else GenerationRecord(number=gen[0], roster=list(gen[1]))
    n = gen[0] if gen else 0
    return ViewSnapshot(
        revision=1, version=1, run=run, run_mod_revision=1,
        members=MappingProxyType(ms), by_age=tuple(ms.values()), generation=g,
        generation_mod_revision=1 if g else 0,
        ready=MappingProxyType({n: frozenset(ready)}),
        broken=MappingProxyType({n: MappingProxyType({b: "" for b in broken})}),
        alive=MappingProxyType({n: frozenset(alive)}),
        drains=frozenset(drains), blacklist=MappingProxyType({h: HostRecord() for h in blacklist}),
        failures=MappingProxyType(failures or {}), progress=None, done=None,
        membership_changed_at=changed_at, departures=tuple(departures),
        event_count=event_count, fenced=MappingProxyType(fenced or {}),
    )
