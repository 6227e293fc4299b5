"""Every decision the leader of a run makes, in one place: :meth:`Leader.step`.

Each member's coordination thread calls :meth:`Leader.step` with the current picture and a
monotonic ``now``; only the *writer* (the oldest eligible member that is not itself silent)
acts. What it decides:

* the elastic timeout: fewer than ``min_np`` eligible members for ``elastic_timeout_s``
  ends the run (a failed ``done``) and raises :class:`ElasticTimeout`;
* which roster members are silent (no proof of life within ``join_timeout_s``, or none yet
  and confirmed dead by a refused probe, :mod:`~peer_elastic.etcd.deaths`; the silence
  clocks are kept here, by every member, so whoever leads next has them);
* the next generation (:func:`~peer_elastic.etcd.roster.plan_next_generation`), or when to
  look again; the reset limit, which ends the run instead;
* the roster budget, halved when etcd refuses a generation record as too large;
* host failures and the blacklist, and the "expired" events of departures;
* pruning of the event log beyond :data:`EVENTS_KEPT`.

Writes go through :class:`LeaderWrites` (etcd: :class:`~peer_elastic.etcd.writer.RunWriter`),
and time only through ``now`` and ``wall``, so tests can drive a leader with a fake writer
and a fake clock. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from peer_elastic.errors import ElasticTimeout, EtcdRequestTooLarge, PeerElasticError
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.deaths import Death
from peer_elastic.etcd.roster import (
    ROSTER_BUDGET_BYTES,
    GenerationPlan,
    Wait,
    plan_next_generation,
    roster_bytes,
    silence_deadline,
    silent_members,
)
from peer_elastic.etcd.view import Member, ViewSnapshot
from peer_elastic.etcd.writer import EventsPruned, Written
from peer_elastic.records import DoneCause, JobConfig

log = logging.getLogger(__name__)

#: The leader keeps the newest this many events of a run and deletes older ones (once
#: there are 10% more), so the log stays bounded however long a job runs.
EVENTS_KEPT = 2000


class LeaderWrites(Protocol):
    """What a leader writes; :class:`~peer_elastic.etcd.writer.RunWriter` against etcd."""

    member_id: str

    def etcd_settled_at(self) -> float: ...

    def recheck_etcd_settled_at(self) -> float: ...

    def event(self, kind: str, detail: str = "", member_id: str | None = None,
              generation: int = 0) -> None: ...

    def prune_events(self, keep: int) -> EventsPruned: ...

    def write_done(self, success: bool, reason: str, cause: int, generation: int,
                   timeout_s: float | None = None) -> bool: ...

    def count_host_failure(self, host: str, member_id: str, count: int,
                           mod_revision: int) -> None: ...

    def blacklist_host(self, host: str, member_id: str, count: int, cooldown_s: float) -> None: ...

    def write_generation(self, snap: ViewSnapshot, plan: GenerationPlan, detected_unix: float,
                         silent: Mapping[str, str] | None = None) -> Written: ...

    def revoke(self, lease_id: int) -> None: ...


def _writer(snap: ViewSnapshot, eligible: Sequence[Member], silent: Mapping[str, str]) -> str | None:
    """Who writes: the oldest eligible member that is not itself silent, so a silent leader
    is replaced by the next-oldest."""
    if not eligible:
        # Every member is drained (``peer-elastic drain --all``): someone must still write
        # the empty roster that lets them all leave together, so the oldest live member
        # does (the plan can then only be that empty roster).
        return next((m.id for m in snap.by_age if m.id not in silent), None)
    return next((m.id for m in eligible if m.id not in silent), None)


class Leader:
    """The leader decisions of one member of ``job``; see the module docstring.

    ``writer`` is replaced when the member re-registers; the rest (silence clocks, the
    elastic timeout's start, the roster budget) outlives registrations. ``counters`` (its
    coordinator's) count ``generations_written``, ``cas_lost`` and ``dropped``.
    """

    def __init__(self, job: str, writer: LeaderWrites | None = None,
                 counters: CoordinatorCounters | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.job = job
        self.writer = writer
        self.counters = counters if counters is not None else CoordinatorCounters()
        self.wall = wall
        # Lowered when etcd refuses a generation record as too large (a server started with
        # a --max-request-bytes below the default): the next plan caps the roster under it.
        self.roster_budget = ROSTER_BUDGET_BYTES
        self.events_kept = EVENTS_KEPT
        # The view's revision when this leader last pruned, and the etcd revision from which
        # on a view has seen that prune: between the two, the view's count is stale.
        self._prune_unseen = range(0)
        self._short_since: float | None = None
        self._departure_seq = 0
        #: Whether this member wrote (or would have written) at its last step. A member
        #: that does not write needs to react to fewer changes (view.WakeOn); until its
        #: first step it is taken to write, so it misses nothing.
        self.writes = True
        self._gen_seen_at: dict[int, float] = {}  # when this member first saw generation n
        self._broken_seen_at: dict[int, float] = {}  # ... and first saw n broken

    # -- observing --------------------------------------------------------------------------------

    def observe(self, snap: ViewSnapshot, now: float) -> None:
        """Start the silence clocks of what ``snap`` shows first (idempotent per ``now``)."""
        gen = snap.generation
        if gen is None:
            return
        if gen.number not in self._gen_seen_at:
            self._gen_seen_at[gen.number] = now
            for table in (self._gen_seen_at, self._broken_seen_at):  # only n and n-1 matter
                for old in [k for k in table if k < gen.number - 1]:
                    del table[old]
        if snap.broken.get(gen.number):
            self._broken_seen_at.setdefault(gen.number, now)

    # -- deciding ---------------------------------------------------------------------------------

    def step(self, snap: ViewSnapshot, now: float,
             deaths: Mapping[str, Death] | None = None) -> float | None:
        """Make every leader decision for ``snap`` at monotonic ``now``; ``deaths`` are the
        members confirmed dead by probe (:class:`~peer_elastic.etcd.deaths.DeathProber`).

        Returns when to look again if time matters (else on the next change). Raises
        :class:`ElasticTimeout` when the run failed for want of peers.
        """
        assert self.writer is not None and snap.run is not None
        self.observe(snap, now)
        cfg = snap.run.config
        eligible = snap.eligible_members()
        self._check_elastic_timeout(snap, len(eligible), cfg, now)
        settled = self.writer.etcd_settled_at()
        ready_since, alive_since = self._silence_starts(snap, cfg)
        silent = silent_members(snap, ready_since, cfg.join_timeout_s, now, settled,
                                alive_since, deaths)
        writer = _writer(snap, eligible, silent)
        if writer == self.writer.member_id and any(m not in (deaths or {}) for m in silent):
            # Silence by the clock alone may be an etcd election this member has not heard
            # of yet (the acks stalled in it): the writer asks etcd once before acting on it.
            rechecked = self.writer.recheck_etcd_settled_at()
            if rechecked != settled:
                settled = rechecked
                silent = silent_members(snap, ready_since, cfg.join_timeout_s, now, settled,
                                        alive_since, deaths)
                writer = _writer(snap, eligible, silent)
        self.writes = writer == self.writer.member_id
        if not self.writes:
            self._departure_seq = snap.departures[-1].seq if snap.departures else 0
            # It becomes the writer if the members ahead of it fall silent: look again
            # then (otherwise on the next change; see Coordinator's idle tick).
            return None if silent else self._silence_look(snap, settled, cfg, ready_since,
                                                          alive_since)
        self._count_failures(snap, cfg)
        self._prune_events(snap)
        plan = plan_next_generation(snap, cfg, silent, now, self.roster_budget, deaths)
        if isinstance(plan, Wait):
            return self._next_look(snap, plan, bool(silent), settled, cfg,
                                   ready_since, alive_since)
        if cfg.reset_limit and plan.number - 1 > cfg.reset_limit:
            self._fail_run(snap, f"reset limit exceeded: {plan.number - 1} resets > "
                                 f"reset_limit={cfg.reset_limit}", DoneCause.DONE_CAUSE_RESET_LIMIT)
            return None
        self.write_generation(snap, plan, now, silent)
        return None

    def _silence_starts(self, snap: ViewSnapshot, cfg: JobConfig
                        ) -> tuple[float | None, float | None]:
        """When the silence clocks of the current generation's ``ready`` and ``alive``
        acks start: when this member saw it (broken), and again whenever an ack for it
        arrives, at most ``lease_ttl_s`` later.

        Acks still arriving mean the members are working through a backlog (an overloaded
        host, this member's own process behind on its watch), not that the rest hung.
        Dropping them then is what fed the rejoin loop on a starved machine: every drop
        is a rejoin, every rejoin a generation that everyone must acknowledge again. A
        member that really hung is dropped once the acks stop for ``join_timeout_s``, or
        at the cap; one whose process died loses its lease, or is confirmed dead by probe.
        """
        n = snap.generation_number
        last_ack = snap.acks_arrived_at.get(n)

        def start(seen: float | None) -> float | None:
            if seen is None or last_ack is None:
                return seen
            return min(max(seen, last_ack), seen + cfg.lease_ttl_s)

        return start(self._gen_seen_at.get(n)), start(self._broken_seen_at.get(n))

    def _next_look(self, snap: ViewSnapshot, plan: Wait, silent: bool, settled: float,
                   cfg: JobConfig, ready_since: float | None,
                   alive_since: float | None) -> float | None:
        """When a waiting leader must look again without a change: when the planner says,
        or when a roster member's silence could start (see ``silent_members``)."""
        if silent or snap.generation is None or plan.until is not None:
            return plan.until
        return self._silence_look(snap, settled, cfg, ready_since, alive_since)

    def _silence_look(self, snap: ViewSnapshot, settled: float, cfg: JobConfig,
                      ready_since: float | None, alive_since: float | None) -> float | None:
        """When a roster member's silence could start (see ``silent_members``); None when
        no member owes an ack."""
        gen = snap.generation
        if gen is None:
            return None
        floor = max(snap.connected_at, settled)
        deadlines = []
        if ready_since is not None and snap.roster_lacks_ready():
            deadlines.append(silence_deadline(ready_since, floor, cfg.join_timeout_s))
        if alive_since is not None and snap.roster_lacks_alive():
            deadlines.append(silence_deadline(alive_since, floor, cfg.join_timeout_s))
        return min(deadlines) if deadlines else None

    def _check_elastic_timeout(self, snap: ViewSnapshot, available: int, cfg: JobConfig,
                               now: float) -> None:
        if available >= cfg.min_np:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since = now
        elif now - self._short_since > cfg.elastic_timeout_s:
            # The run fails as a whole: record it (the first writer wins), so peers that
            # systemd restarts, and late joiners, see a failed job instead of waiting again.
            self._fail_run(snap, f"elastic timeout: fewer than min_np={cfg.min_np} peers "
                                 f"for {cfg.elastic_timeout_s:.0f} s",
                           DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT)
            raise ElasticTimeout(
                f"job {self.job!r}: only {available} of min_np={cfg.min_np} peers were "
                f"available for {cfg.elastic_timeout_s:.0f} s (elastic timeout); giving up. "
                "Start more peers, or lower min_np / raise PEER_ELASTIC_ELASTIC_TIMEOUT."
            )

    def _fail_run(self, snap: ViewSnapshot, reason: str, cause: int) -> None:
        assert self.writer is not None
        if self.writer.write_done(False, reason, cause, snap.generation_number):
            log.error("job %s failed: %s", self.job, reason)

    # -- generations ------------------------------------------------------------------------------

    def write_generation(self, snap: ViewSnapshot, plan: GenerationPlan, now: float,
                         silent: Mapping[str, str] | None = None) -> bool:
        """Write ``plan`` (guarded; see :meth:`RunWriter.write_generation`), then revoke the
        leases of the members it dropped. True if ours is the new generation."""
        assert self.writer is not None
        wall = self.wall()
        if plan.broken or plan.dropped:
            detected = wall  # acted on the moment it was seen
        else:  # a join or leave, batched for settle_s: it happened when membership changed
            detected = wall - max(0.0, now - snap.membership_changed_at)
        try:
            written = self.writer.write_generation(snap, plan, detected, silent)
        except EtcdRequestTooLarge as exc:
            self._shrink_roster_budget(snap, plan, exc)
            return False
        if written is not Written.WRITTEN:
            self.counters.cas_lost += 1
            return False
        self.counters.generations_written += 1
        for m in plan.dropped:
            member = snap.members.get(m)
            if member is not None:
                self.counters.dropped += 1
                self.writer.revoke(member.record.lease_id)
        return True

    def _shrink_roster_budget(self, snap: ViewSnapshot, plan: GenerationPlan,
                              exc: EtcdRequestTooLarge) -> None:
        """etcd refused generation ``plan`` as too large: halve the roster budget, so the
        next plan leaves the rest as standbys, or fail clearly if the roster is minimal."""
        assert self.writer is not None and snap.run is not None
        size = roster_bytes(plan.roster)
        min_np = snap.run.config.min_np
        if len(plan.roster) <= max(1, min_np):
            raise PeerElasticError(
                f"etcd refused generation {plan.number} of {len(plan.roster)} members as too "
                f"large ({exc}); even min_np={min_np} members do not fit. Raise etcd's "
                "--max-request-bytes (default 1.5 MiB).")
        self.roster_budget = min(self.roster_budget, size) // 2
        msg = (f"etcd refused generation {plan.number} of {len(plan.roster)} members "
               f"({size} bytes of member ids) as too large; the roster is capped at "
               f"{self.roster_budget} bytes from now on, the other members wait as standbys. "
               "Raise etcd's --max-request-bytes to admit them.")
        log.error("%s", msg)
        self.writer.event("generation too large", detail=msg, generation=snap.generation_number)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _count_failures(self, snap: ViewSnapshot, cfg: JobConfig) -> None:
        """Count non-graceful departures per host; blacklist a host past the threshold."""
        assert self.writer is not None
        fresh = [d for d in snap.departures if d.seq > self._departure_seq]
        if snap.departures:
            self._departure_seq = snap.departures[-1].seq
        n = snap.generation_number
        for d in fresh:
            if not d.graceful:
                self.writer.event("expired", member_id=d.member_id, generation=n,
                                  detail=f"host {d.host}: lease ended without a graceful leave")
        if not cfg.blacklist_after:
            return
        for d in fresh:
            if d.graceful:
                continue
            prev, mod = snap.failures.get(d.host, (None, 0))
            count = (prev.failures if prev else 0) + 1
            if count >= cfg.blacklist_after:
                self.writer.blacklist_host(d.host, d.member_id, count, cfg.blacklist_cooldown_s)
                self.writer.event("blacklisted", generation=n,
                                  detail=f"{d.host}: {count} failures; excluded for "
                                         f"{cfg.blacklist_cooldown_s:.0f} s")
            else:
                self.writer.count_host_failure(d.host, d.member_id, count, mod)

    def _prune_events(self, snap: ViewSnapshot) -> None:
        """Delete the oldest events beyond ``events_kept`` (keys sort by time).

        Unbounded, the log would outgrow what one read may carry and what etcd should hold.
        Runs when the view counts 10% over the cap, so it costs four requests per cap/10
        events. Not while the view has yet to see this leader's previous prune (its count
        is stale then): keyed on the count instead, a log that regrew to exactly the count
        of the previous prune was left over the bound until the next event. The writer
        counts the excess in etcd all the same. A view whose revision went back (etcd
        replaced) is taken as fresh.
        """
        assert self.writer is not None
        keep = max(1, self.events_kept)
        if snap.event_count <= keep + max(1, keep // 10) or snap.revision in self._prune_unseen:
            return
        pruned = self.writer.prune_events(keep)
        self._prune_unseen = range(snap.revision, pruned.revision)
