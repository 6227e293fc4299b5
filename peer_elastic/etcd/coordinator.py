"""One peer's side of the coordination: its session, the ack thread, and the waits.

A :class:`Coordinator` registers the peer as a member of the job's current run (starting a
run if there is none; :mod:`~peer_elastic.etcd.registration`), keeps its lease alive, and
runs one coordination thread that reacts to every change of the watched
:class:`~peer_elastic.etcd.view.JobView`:

* it acknowledges each generation that lists the peer as soon as it sees it (proof of life:
  a peer busy in a long training step is not taken for dead), and answers "alive" when the
  generation broke;
* it hands the picture to its :class:`~peer_elastic.etcd.leader.Leader`, which acts only
  when this peer is the leader (the oldest eligible member): generations, drops, the
  blacklist, the elastic timeout and the reset limit;
* when its own lease is lost it ends that registration at once (:attr:`incarnation`
  changes, so the training side stops using the groups formed under it) and registers again
  as a new member (a joiner) once the training thread has left those groups
  (:meth:`hold_rejoin`; :mod:`~peer_elastic.etcd.rejoin`).

Its :class:`~peer_elastic.etcd.deaths.DeathProber` probes the members whose missing acks
stand between this peer and writing (or, for the writer, all of them), so a crashed member
is dropped when its probe port refuses, not ``join_timeout_s`` later.

The training side (torch layer) only reads memory here: :attr:`latest_generation` and the
``wait_*`` methods. Nothing in this module imports torch, so many members can be simulated
in one process (pass a shared ``view`` and ``keeper``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from peer_elastic.config import JobSettings
from peer_elastic.errors import EtcdError, PeerElasticError
from peer_elastic.etcd.admin import drain
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.deaths import DeathProber
from peer_elastic.etcd.done import FINISH_TIMEOUT_S
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.leader import Leader
from peer_elastic.etcd.lease import Lane, LeaseKeeper, Session
from peer_elastic.etcd.owed_acks import OwedAcks
from peer_elastic.etcd.registration import Identity, register
from peer_elastic.etcd.rejoin import Listing, Rejoin
from peer_elastic.etcd.reports import MemberReports
from peer_elastic.etcd.stop import participation_end
from peer_elastic.etcd.view import JobView, ViewSnapshot, WakeOn
from peer_elastic.etcd.writer import AckKind, RunWriter
from peer_elastic.process import threads
from peer_elastic.records import (
    DoneCause,
    GenerationCause,
    GenerationRecord,
    JobConfig,
    ProgressRecord,
    RunRecord,
)

log = logging.getLogger(__name__)

_TICK_S = 0.25  # longest the coordination thread sleeps without a change
#: ... when it is not the writer and neither a silence clock nor a rejoin is running: every
#: time-bound decision of a follower returns when it is due (Leader.step), so this tick is
#: only a safety net. Hundreds of members in one process each waking four times a second
#: starved its lease keeper of the GIL (a rejoin storm at 2,048 members on 2 cores).
_IDLE_TICK_S = 1.0


@dataclass(frozen=True)
class Assignment:
    """This peer's place in one generation."""

    generation: int
    rank: int
    size: int
    roster: tuple[str, ...]
    joined: bool  # admitted in this generation (a newcomer or a returning member)
    reason: str  # for humans
    causes: tuple[GenerationCause, ...] = ()  # why the generation formed, typed

    @classmethod
    def of(cls, snap: ViewSnapshot, member_id: str) -> Assignment | None:
        """``member_id``'s place in ``snap``'s generation, or None (a standby, or no
        generation yet)."""
        gen = snap.generation
        if gen is None or member_id not in snap.roster_ids():
            return None
        return cls(gen.number, list(gen.roster).index(member_id), len(gen.roster),
                   tuple(gen.roster), member_id in gen.joined, gen.reason, tuple(gen.causes))


class _Closed(PeerElasticError):
    """Internal: the coordinator was closed while (re-)registering; nothing was registered."""


class Coordinator:
    """Membership and generations for one peer; see the module docstring."""

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        settings: JobSettings | None = None,
        *,
        host: str | None = None,
        address: str = "",
        local_rank: int = 0,
        labels: Mapping[str, str] | None = None,
        view: JobView | None = None,
        keeper: LeaseKeeper | None = None,
        auto_rejoin: bool = True,
        net_address: str = "",
        probe_port: int = 0,
    ) -> None:
        self.client = client
        self.job = job
        self.settings = settings or JobSettings()
        self.config: JobConfig = self.settings.resolved()  # validates before touching etcd
        self._config_source: JobConfig | None = None  # the run record's, self.config is from
        self.identity = Identity.of_this_process(host, address, local_rank, labels,
                                                 net_address, probe_port)
        self.host = self.identity.host
        self.local_rank = local_rank
        self.view = view or JobView(client, job)
        self._own_keeper = keeper is None
        self._keeper = keeper

        self.run: RunRecord | None = None
        self.keys: RunKeys | None = None
        self.writer: RunWriter | None = None
        self.member_id = ""
        # Bumped when this peer registers first and each time it loses its registration: a
        # group formed under another incarnation belongs to a lost registration.
        self.incarnation = 0
        self._session: Session | None = None
        self._lock = threading.Lock()  # guards _session / member_id / error across threads
        self._acks = OwedAcks()
        self.drain_requested = threading.Event()
        self.error: PeerElasticError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # What this coordination thread did (the training side counts in Peer.stats).
        self.counters = CoordinatorCounters()
        self.leader = Leader(job, counters=self.counters)
        self.rejoin = Rejoin(self.counters, self.view.wake, auto=auto_rejoin)
        self.deaths = DeathProber(on_confirmed=self.view.wake)
        self.reports = MemberReports(self._current_writer)

    # -- start ------------------------------------------------------------------------------------

    def start(self) -> Coordinator:
        """Join (or start) the job's run and start the coordination thread.

        Raises :class:`JobFinished` when the run already ended, :class:`ConfigError` when the
        settings differ from the run's, :class:`EtcdUnavailable` when etcd cannot be reached.
        """
        if self._keeper is None:
            self._keeper = LeaseKeeper(self.client, name=f"lease-keeper:{self.job}")
        self.incarnation += 1
        try:
            self.view.start()  # reads etcd first: unreachable, it raises, and no thread stays
            self._register()
        except BaseException:
            self._shutdown_threads()
            raise
        self._thread = threads.start(self._coordination_loop, f"coordinator:{self.member_id}")
        return self

    def _register(self) -> None:
        """Register (see :func:`~peer_elastic.etcd.registration.register`) and adopt it."""
        assert self._keeper is not None
        reg = register(self.client, self.job, self.settings, self.identity, self._keeper,
                       self._on_lease_lost, self._check_not_closed)
        with self._lock:
            # close() and this registration race: whichever comes second under the lock
            # revokes the new lease (close() revokes the session it finds), so a closed
            # coordinator never leaves a member behind.
            closed = self._stop.is_set()
            if not closed:
                self.run, self.keys, self.config = reg.run, reg.keys, reg.config
                self.writer = RunWriter(self.client, reg.keys, reg.run.lease_id, reg.member_id)
                self.leader.writer = self.writer
                self._session = reg.session
                self.member_id = reg.member_id
                self._acks.forget()
                self.rejoin.registered()
        if closed:
            reg.session.close(revoke=True)
            raise _Closed(f"job {self.job!r}: closed while registering; registration undone")
        # Its own lane: member leases of this process never delay the run lease's refresh.
        # Next refreshed an interval after the registration granted or refreshed it; at
        # once when it did neither (another member of this process kept the lease then,
        # and may have let it go since).
        self._keeper.keep(reg.run.lease_id, self.config.run_ttl_s, self._on_run_lease_lost,
                          lane=Lane.RUN, refresh_now=reg.run_lease_since is None,
                          granted_since=reg.run_lease_since)
        log.info("joined job %s run %s as %s (lease %x)", self.job, reg.run.run_id,
                 reg.member_id, reg.session.lease_id)
        self.record_event("joined", detail=f"host {self.host} pid {os.getpid()}")
        # Wait until our own watch shows us, so "am I a member" questions are answered.
        self.view.wait_for(lambda s: reg.member_id in s.members,
                           timeout=max(5.0, self.config.lease_ttl_s))

    def _check_not_closed(self) -> None:
        if self._stop.is_set():
            raise _Closed(f"job {self.job!r}: closed; not registering")

    # -- lease loss -------------------------------------------------------------------------------

    def _on_lease_lost(self, lease_id: int, why: str) -> None:
        with self._lock:
            if self._session is None or self._session.lease_id != lease_id:
                return
            self.rejoin.lease_lost(self.member_id, why)
        self.view.wake()

    def hold_rejoin(self, until: Callable[[], bool] | None) -> None:
        """After a lost lease, register again only once ``until()`` holds (None: at once).

        The training side passes "my training thread has left every group formed under a
        lost registration" (:meth:`Rejoin.hold <peer_elastic.etcd.rejoin.Rejoin.hold>`).
        """
        self.rejoin.hold(until)

    def _current_writer(self) -> tuple[RunWriter | None, int | None]:
        """This registration's writer and member lease id, read together (None: lost)."""
        with self._lock:
            return self.writer, (self._session.lease_id if self._session else None)

    def _on_run_lease_lost(self, lease_id: int, why: str) -> None:
        self._fail(PeerElasticError(
            f"run {self.run.run_id if self.run else '?'} of job {self.job!r} ended: its lease "
            f"is gone ({why})"))

    def _fail(self, err: PeerElasticError) -> None:
        with self._lock:
            if self.error is None:
                self.error = err
                log.error("%s", err)
        self.view.wake()

    # -- reading (no etcd I/O) --------------------------------------------------------------------

    def snapshot(self) -> ViewSnapshot:
        return self.view.snapshot()

    @property
    def latest_generation(self) -> GenerationRecord | None:
        return self.view.snapshot().generation

    @property
    def lease_id(self) -> int:
        return self._session.lease_id if self._session else 0

    @property
    def is_leader(self) -> bool:
        eligible = self.snapshot().eligible()
        return bool(eligible) and eligible[0].id == self.member_id

    def assignment(self, snap: ViewSnapshot | None = None) -> Assignment | None:
        """Our place in the current generation, or None (standby, or no generation yet)."""
        return Assignment.of(snap or self.snapshot(), self.member_id)

    def check(self, snap: ViewSnapshot | None = None) -> None:
        """Raise whatever ends this peer's participation: fatal error, done, a drain that
        took effect (decided by :func:`~peer_elastic.etcd.stop.stop_reason`)."""
        error = participation_end(self, snap or self.snapshot())
        if error is not None:
            raise error

    # -- waiting ----------------------------------------------------------------------------------

    def wait_generation(self, after: int = 0, timeout: float | None = None) -> Assignment:
        """Block until a generation newer than ``after`` lists this peer.

        Standbys wait here until they are promoted. Raises :class:`JobFinished`,
        :class:`ElasticTimeout`, other fatal errors, or ``TimeoutError``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        version = -1
        while True:
            snap = self.snapshot()
            if snap.version != version:
                self.check(snap)
                a = self.assignment(snap)
                if a is not None and a.generation > after and not self.rejoin.pending:
                    return a
                version = snap.version
            left = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no generation after {after} listed {self.member_id} in time")
            self.view.wait_change(version, left)
            if self.error is not None:
                raise self.error

    def wait_ready(self, generation: int, timeout: float | None = None) -> bool:
        """Wait until every roster member of ``generation`` acked it.

        False when a newer generation superseded it first (form that one instead).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            self.check(snap)
            gen = snap.generation
            if gen is None or gen.number != generation:
                return False
            if not snap.roster_lacks_ready():  # once per snapshot, not per member
                return True
            left = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"generation {generation} was not acknowledged in time")
            self.view.wait_change(snap.version, left)

    # -- actions requested by the training side ---------------------------------------------------

    def mark_broken(self, generation: int, detail: str = "") -> bool:
        """Say that a collective of ``generation`` failed, so the leader proposes the next
        now; best effort (:meth:`MemberReports.mark_broken
        <peer_elastic.etcd.reports.MemberReports.mark_broken>`)."""
        return self.reports.mark_broken(generation, detail)

    def report_unreachable(self, members: Collection[str], generation: int) -> bool:
        """Record that this member's process groups cannot reach ``members`` (best effort)."""
        return self.reports.report_unreachable(members, generation)

    def clear_unreachable(self) -> bool:
        """Withdraw this member's report: everyone it named answers again (best effort)."""
        return self.reports.clear_unreachable()

    def request_leave(self, requested_by: str = "") -> None:
        """Ask to be drained: the next generation forms without this peer, with no rollback."""
        self.drain_requested.set()
        drain(self.client, self.job, self.member_id, requested_by or self.member_id)
        self.view.wait_for(lambda s: self.member_id in s.drains, timeout=self.config.lease_ttl_s)

    def record_progress(self, **fields: int) -> None:
        """Write the last committed position (rank 0 calls this; ``status`` shows it)."""
        assert self.writer is not None
        self.writer.progress(ProgressRecord(unix=time.time(), **fields))

    def record_state(self, commits: int, generation: int) -> None:
        """Say in etcd that the run's training state has ``commits`` commits (rank 0 calls
        this after commits); best effort."""
        self.reports.record_state(commits, generation)

    def finish(self, success: bool = True, reason: str = "",
               timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Record the end of the run in ``done`` and return once etcd holds it.

        Create-if-absent, so any number of peers may call it (every rank does when training
        returns) and the first record stays. True if this call wrote it. While etcd does not
        answer it keeps trying for ``timeout_s``, then raises :class:`EtcdUnavailable`: a
        run whose end is not recorded would be trained again by the next peer to start.
        (:func:`~peer_elastic.etcd.done.write_done`, the one writer of ``done``.)
        """
        assert self.writer is not None
        created = self.writer.write_done(success, reason, DoneCause.DONE_CAUSE_RETURNED,
                                         self.snapshot().generation_number, timeout_s)
        if created:
            self.record_event("done", detail=("success" if success else "failure: " + reason))
        return created

    def close(self, leave: bool = True) -> None:
        """Stop coordinating. With ``leave``, revoke the lease so others see us go at once."""
        with self._lock:  # see the end of _register: close() wins a race with a rejoin
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        self.view.wake()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        with self._lock:
            session = self._session
        if session is not None:
            if leave and not self.rejoin.pending and self.snapshot().done is None \
                    and self.writer is not None:
                # A deliberate exit is a graceful departure, not a failure: the leader must
                # not count it towards the blacklist or log it as expired.
                self.writer.mark_leaving(self.snapshot().generation_number)
            session.close(revoke=leave)
        if self.run is not None and self._keeper is not None:
            self._keeper.forget(self.run.lease_id, self._on_run_lease_lost)
        self._shutdown_threads()

    def _shutdown_threads(self) -> None:
        self.deaths.stop()
        if self._own_keeper and self._keeper is not None:
            self._keeper.stop()
        self.view.stop()

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the coordination thread ------------------------------------------------------------------

    def _coordination_loop(self) -> None:
        versions = {kind: -1 for kind in WakeOn}  # the view's version of each kind of change
        wake_at: float | None = None
        deaths_seen = -1
        while not self._stop.is_set():
            tick = _TICK_S if self.leader.writes or self.rejoin.pending else _IDLE_TICK_S
            timeout = tick if wake_at is None else max(0.0, min(tick, wake_at - time.monotonic()))
            # The writer reacts to every change; the others to what concerns them (a step
            # reads the newest picture whenever it runs, so this only saves wake-ups; the
            # tick still looks at the clocks).
            wake_on = WakeOn.ANY_CHANGE if self.leader.writes else WakeOn.FOLLOWER_CHANGE
            versions[wake_on] = self.view.wait_change(
                versions[wake_on], timeout, until=lambda seen=deaths_seen: self._stop.is_set()
                or self.rejoin.due(registered=self._session is not None)
                or self.deaths.version != seen,  # a death confirmed: decide at once
                wake_on=wake_on)
            deaths_seen = self.deaths.version
            if self._stop.is_set():
                return
            try:
                wake_at = self._step()
            except _Closed:
                return
            except EtcdError as exc:
                log.warning("coordination step failed, retrying: %s", exc)
                self._stop.wait(0.2)
            except PeerElasticError as exc:
                self._fail(exc)
                return
            except Exception:
                log.exception("coordination step failed unexpectedly; retrying")
                self._stop.wait(0.5)

    def _step(self) -> float | None:
        """React to the current picture once. Returns when to look again, if time matters."""
        if self.error is not None:
            return None
        if self.rejoin.pending:
            self.rejoin.act(self.member_id, self._session is not None,
                            self._end_registration, self._register_again)
            return None
        snap = self.snapshot()
        if snap.done is not None:
            return None  # waiters see it in the snapshot
        if snap.run is None or self.run is None or snap.run.run_id != self.run.run_id:
            # We keep the run lease alive, so the run only goes if that failed for good.
            if self.run is not None:
                raise PeerElasticError(f"run {self.run.run_id} of job {self.job!r} disappeared")
            return None
        listing = self.rejoin.observe_listing(self.member_id in snap.members, self.incarnation)
        if listing is Listing.GONE:  # revoked by the leader for silence, or expired
            return self._step()
        if listing is Listing.NOT_YET:
            return None  # our registration has not reached the view yet
        now = time.monotonic()
        self.leader.observe(snap, now)  # silence clocks start when we see, even if acks fail
        for kind in self._acks.owed(snap, self.member_id):
            self._ack(kind, snap.generation_number)
        if self.member_id in snap.drains:
            self.drain_requested.set()
        if snap.run.config is not self._config_source:  # a new run record: adopt it
            # Never the run record's per-peer settings (snapshot_dir): this peer's own.
            self.config = self.settings.for_this_peer(snap.run.config)
            self._config_source = snap.run.config
        self.deaths.update(snap, self.member_id)
        return self.leader.step(snap, now, self.deaths.confirmed())

    def _ack(self, kind: AckKind, n: int) -> None:
        assert self.writer is not None
        self.writer.ack(kind, n, self.lease_id)
        self._acks.given(kind, n)

    def _end_registration(self) -> None:
        """Revoke the lost registration's lease (rejoin's first step)."""
        with self._lock:
            session, self._session = self._session, None
            self.incarnation += 1  # the training side stops using the old groups (LEASE_LOST)
        assert session is not None
        session.close(revoke=True)  # the key may still exist if we merely stalled

    def _register_again(self) -> str:
        """Register as a new member (rejoin's second step); the new member id."""
        self._register()
        return self.member_id

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None, timings: Mapping[str, float] | None = None,
                     ) -> None:
        """Append to the run's event log (best effort: a lost event is logged, not raised)."""
        if self.writer is None:
            return
        self.writer.event(kind, detail, member_id,
                          generation or self.snapshot().generation_number, timings)
