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
  (:meth:`hold_rejoin`): listed earlier, it would make the others wait in their next
  rendezvous for a thread still stuck in an old collective.

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
from peer_elastic.errors import (
    ConfigError,
    EtcdError,
    LeaseLost,
    LeaveRequested,
    PeerElasticError,
)
from peer_elastic.etcd.admin import drain
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.deaths import DeathProber
from peer_elastic.etcd.done import FINISH_TIMEOUT_S, done_error
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.leader import Leader
from peer_elastic.etcd.lease import Lane, LeaseKeeper, Session
from peer_elastic.etcd.registration import Identity, default_host, register
from peer_elastic.etcd.stop import LEAVE_JOB, StopCause, stop_reason
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
    valid_name,
)

log = logging.getLogger(__name__)

_TICK_S = 0.25  # longest the coordination thread sleeps without a change


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
        self.host = host or default_host()
        if not valid_name(self.host):
            raise ConfigError(f"invalid host name {self.host!r} for a member id")
        self.address = address
        self.local_rank = local_rank
        self.labels = dict(labels or {})
        self.identity = Identity(self.host, address, local_rank, self.labels, net_address,
                                 probe_port)
        self.view = view or JobView(client, job)
        self._own_keeper = keeper is None
        self._keeper = keeper
        self.auto_rejoin = auto_rejoin

        self.run: RunRecord | None = None
        self.keys: RunKeys | None = None
        self.writer: RunWriter | None = None
        self.member_id = ""
        # Bumped when this peer registers first and each time it loses its registration: a
        # group formed under another incarnation belongs to a lost registration.
        self.incarnation = 0
        self._rejoin_gate: Callable[[], bool] | None = None  # see hold_rejoin
        self._session: Session | None = None
        self._lock = threading.Lock()  # guards _session / member_id / error across threads
        self._acked: set[int] = set()
        self._alive_acked: set[int] = set()
        self._seen_incarnation = -1  # last incarnation our own view has listed
        self._lost_lease = threading.Event()
        self.drain_requested = threading.Event()
        self.error: PeerElasticError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # What this coordination thread did (the training side counts in Peer.stats).
        self.stats = {"generations_written": 0, "cas_lost": 0, "rejoins": 0, "dropped": 0}
        self.leader = Leader(job, stats=self.stats)  # counts generations_written, cas_lost, dropped
        self.deaths = DeathProber(on_confirmed=self.view.wake)

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
                self._lost_lease.clear()
        if closed:
            reg.session.close(revoke=True)
            raise _Closed(f"job {self.job!r}: closed while registering; registration undone")
        # Its own lane: member leases of this process never delay the run lease's refresh.
        # Refreshed at once: the run may be adopted from peers that died a while ago (a
        # whole job restarted, slow to start on a loaded machine), its lease near its end.
        self._keeper.keep(reg.run.lease_id, self.config.run_ttl_s, self._on_run_lease_lost,
                          lane=Lane.RUN, refresh_now=True)
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
            log.warning("member %s lost its lease: %s", self.member_id, why)
            self._lost_lease.set()
        self.view.wake()

    def hold_rejoin(self, until: Callable[[], bool] | None) -> None:
        """After a lost lease, register again only once ``until()`` holds (None: at once).

        The training side passes "my training thread has left every group formed under a
        lost registration". It is asked on the coordination thread, under the view's lock,
        so it must only read memory; whoever makes it true calls ``view.wake()``.
        """
        self._rejoin_gate = until
        self.view.wake()

    def _may_register(self) -> bool:
        gate = self._rejoin_gate
        return gate is None or gate()

    def _rejoin_due(self) -> bool:
        """A lost lease the coordination thread has yet to act on: end the registration, or
        register again now that the gate opened."""
        return self._lost_lease.is_set() and (self._session is not None or self._may_register())

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
        snap = snap or self.snapshot()
        gen = snap.generation
        if gen is None or self.member_id not in snap.roster_ids():
            return None
        return Assignment(gen.number, list(gen.roster).index(self.member_id), len(gen.roster),
                          tuple(gen.roster), self.member_id in gen.joined, gen.reason,
                          tuple(gen.causes))

    def check(self, snap: ViewSnapshot | None = None) -> None:
        """Raise whatever ends this peer's participation: fatal error, done, a drain that
        took effect (decided by :func:`~peer_elastic.etcd.stop.stop_reason`)."""
        snap = snap or self.snapshot()
        reason = stop_reason(self, None, snap, causes=LEAVE_JOB)
        if reason is None:
            return
        if reason.cause is StopCause.FATAL and self.error is not None:
            raise self.error
        if reason.cause is StopCause.JOB_DONE and snap.done is not None:
            raise done_error(self.job, snap.done)
        raise LeaveRequested(reason.detail)

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
                if a is not None and a.generation > after and not self._lost_lease.is_set():
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
            if set(gen.roster) <= snap.ready_for(generation):
                return True
            left = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"generation {generation} was not acknowledged in time")
            self.view.wait_change(snap.version, left)

    # -- actions requested by the training side ---------------------------------------------------

    def mark_broken(self, generation: int, detail: str = "") -> bool:
        """Say that a collective of ``generation`` failed, so the leader proposes the next now.

        Best effort; False when etcd did not take it (unreachable, or our lease is gone).
        The caller is on its way to re-form either way, and must not die of this: the
        leader also learns of the failure from the other ranks' marks, or at worst from the
        missing acks of the peer that failed; a lost lease is handled by rejoining.
        """
        return self._best_effort(
            f"mark generation {generation} broken",
            lambda w, lease: w.ack(AckKind.BROKEN, generation, lease, detail[:500]))

    def report_unreachable(self, members: Collection[str], generation: int) -> bool:
        """Record that this member's process groups cannot reach ``members`` (best effort,
        as :meth:`mark_broken`; :mod:`~peer_elastic.etcd.reach`)."""
        return self._best_effort(
            f"report unreachable members {sorted(members)}",
            lambda w, lease: w.report_unreachable(members, generation, lease))

    def clear_unreachable(self) -> bool:
        """Withdraw this member's report: everyone it named answers again (best effort)."""
        return self._best_effort("withdraw the report of unreachable members",
                                 lambda w, _lease: w.clear_unreachable())

    def _best_effort(self, what: str, write: Callable[[RunWriter, int], object]) -> bool:
        """``write`` with this registration's writer and member lease; False (logged) when
        there is no registration (none yet, or its lease was lost) or etcd did not take it."""
        with self._lock:
            writer, session = self.writer, self._session
        if writer is None or session is None:
            log.info("could not %s: this peer has no registration now", what)
            return False
        try:
            write(writer, session.lease_id)
        except EtcdError as exc:
            log.warning("could not %s: %s", what, exc)
            return False
        return True

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
        this after commits; a group that forms with no holder of the state reads it).
        Best effort: the next commit's mark says it again."""
        self._best_effort("record the state's commits",
                          lambda w, _lease: w.state(commits, generation))

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
            if leave and not self._lost_lease.is_set() and self.snapshot().done is None \
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
            timeout = _TICK_S if wake_at is None else max(0.0, min(_TICK_S, wake_at - time.monotonic()))
            # The writer reacts to every change; the others to what concerns them (a step
            # reads the newest picture whenever it runs, so this only saves wake-ups; the
            # tick still looks at the clocks).
            wake_on = WakeOn.ANY_CHANGE if self.leader.writes else WakeOn.FOLLOWER_CHANGE
            versions[wake_on] = self.view.wait_change(
                versions[wake_on], timeout, until=lambda seen=deaths_seen: self._stop.is_set()
                or self._rejoin_due()
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
        if self._lost_lease.is_set():
            self._rejoin()
            return None
        snap = self.snapshot()
        if snap.done is not None:
            return None  # waiters see it in the snapshot
        if snap.run is None or self.run is None or snap.run.run_id != self.run.run_id:
            # We keep the run lease alive, so the run only goes if that failed for good.
            if self.run is not None:
                raise PeerElasticError(f"run {self.run.run_id} of job {self.job!r} disappeared")
            return None
        if self.member_id in snap.members:
            self._seen_incarnation = self.incarnation
        elif self._seen_incarnation == self.incarnation:
            # Our key is gone (revoked by the leader for silence, or expired): the lease is
            # as good as lost even if the keeper has not noticed yet.
            self._lost_lease.set()
            return self._step()
        else:
            return None  # our registration has not reached the view yet
        now = time.monotonic()
        self.leader.observe(snap, now)  # silence clocks start when we see, even if acks fail
        gen = snap.generation
        if gen is not None:
            self._acked &= {gen.number - 1, gen.number}
            self._alive_acked &= {gen.number - 1, gen.number}
            listed = self.member_id in snap.roster_ids()
            if listed and gen.number not in self._acked:
                self._ack(gen.number)
            if snap.broken.get(gen.number) and listed and gen.number not in self._alive_acked:
                self._ack(gen.number, alive=True)  # proof of life after the break
        if self.member_id in snap.drains:
            self.drain_requested.set()
        if snap.run.config is not self._config_source:  # a new run record: adopt it
            # Never the run record's per-peer settings (snapshot_dir): this peer's own.
            self.config = self.settings.for_this_peer(snap.run.config)
            self._config_source = snap.run.config
        self.deaths.update(snap, self.member_id)
        return self.leader.step(snap, now, self.deaths.confirmed())

    def _ack(self, n: int, alive: bool = False) -> None:
        assert self.writer is not None
        self.writer.ack(AckKind.ALIVE if alive else AckKind.READY, n, self.lease_id)
        (self._alive_acked if alive else self._acked).add(n)

    def _rejoin(self) -> None:
        """Act on a lost lease: end the registration (once), then register anew when the
        gate (:meth:`hold_rejoin`) lets us."""
        if self._session is not None:
            self._end_registration()
        if not self._may_register():
            return  # woken again by the view when the training side leaves its group
        old = self.member_id
        self._register()
        self.stats["rejoins"] += 1
        log.warning("member %s re-registered as %s after losing its lease", old, self.member_id)

    def _end_registration(self) -> None:
        with self._lock:
            session, self._session = self._session, None
            self.incarnation += 1  # the training side stops using the old groups (LEASE_LOST)
        assert session is not None
        session.close(revoke=True)  # the key may still exist if we merely stalled
        self._acked.clear()
        self._alive_acked.clear()
        if not self.auto_rejoin:
            raise LeaseLost(f"member {self.member_id} lost its lease")
        if not self._may_register():
            log.warning("member %s lost its lease; it registers again once its training thread "
                        "has left the process group it was in", self.member_id)

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None, timings: Mapping[str, float] | None = None,
                     ) -> None:
        """Append to the run's event log (best effort: a lost event is logged, not raised)."""
        if self.writer is None:
            return
        self.writer.event(kind, detail, member_id,
                          generation or self.snapshot().generation_number, timings)
