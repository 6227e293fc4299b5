"""One peer's side of the coordination: membership, leadership, generations.

A :class:`Coordinator` registers the peer as a member of the job's current run (starting a
run if there is none), keeps its lease alive, and runs one coordination thread that reacts
to every change of the watched :class:`~peer_elastic.etcd.view.JobView`:

* it acknowledges each generation that lists the peer as soon as it sees it (proof of life:
  a peer busy in a long training step is not taken for dead);
* when the peer is the leader (the oldest eligible member) it writes the next generation
  when the roster must change, guarded by a compare-and-swap on the generation key, so two
  peers that both believe they lead can never both succeed;
* it drops roster members that do not acknowledge within ``join_timeout`` (revoking their
  leases), counts host failures for the blacklist, and enforces the elastic timeout and the
  reset limit;
* when its own lease is lost it re-registers as a new member (a joiner).

The training side (torch layer) only reads memory here: :attr:`latest_generation` and the
``wait_*`` methods. Nothing in this module imports torch, so many members can be simulated
in one process (pass a shared ``view`` and ``keeper``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from peer_elastic import __version__
from peer_elastic.config import JobSettings
from peer_elastic.errors import (
    ConfigError,
    ElasticTimeout,
    EtcdError,
    EtcdRequestTooLarge,
    EtcdUnavailable,
    JobFinished,
    LeaseLost,
    LeaseNotFound,
    LeaveRequested,
    PeerElasticError,
    RecordError,
    ResetLimitExceeded,
)
from peer_elastic.etcd.client import EtcdClient, Txn
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.lease import LeaseKeeper, Session
from peer_elastic.etcd.roster import (
    ROSTER_BUDGET_BYTES,
    GenerationPlan,
    Wait,
    plan_next_generation,
    roster_bytes,
    silent_members,
)
from peer_elastic.etcd.stop import LEAVE_JOB, StopCause, stop_reason
from peer_elastic.etcd.view import JobView, ViewSnapshot
from peer_elastic.records import (
    AckRecord,
    DoneRecord,
    DrainRecord,
    EventRecord,
    GenerationRecord,
    HostRecord,
    JobConfig,
    MemberRecord,
    ProgressRecord,
    RunRecord,
    decode,
    encode,
    valid_name,
)
from peer_elastic.settings_table import HOST

log = logging.getLogger(__name__)

_TICK_S = 0.25  # longest the coordination thread sleeps without a change

#: The leader keeps the newest this many events of a run and deletes older ones (once
#: there are 10% more), so the log stays bounded however long a job runs.
EVENTS_KEPT = 2000

#: How long :meth:`Coordinator.finish` keeps trying to record the end of the run while
#: etcd does not answer, before it gives up with a clear error.
FINISH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Assignment:
    """This peer's place in one generation."""

    generation: int
    rank: int
    size: int
    roster: tuple[str, ...]
    joined: bool  # admitted in this generation (a newcomer or a returning member)
    reason: str


def default_host() -> str:
    host = HOST.raw() or socket.gethostname() or "localhost"
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in host)[:64]
    return host if valid_name(host) else "host"


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
    ) -> None:
        self.client = client
        self.job = job
        self.settings = settings or JobSettings()
        self._wanted = self.settings.resolved()  # validates before touching etcd
        self.host = host or default_host()
        if not valid_name(self.host):
            raise ConfigError(f"invalid host name {self.host!r} for a member id")
        self.address = address
        self.local_rank = local_rank
        self.labels = dict(labels or {})
        self._own_view = view is None
        self.view = view or JobView(client, job)
        self._own_keeper = keeper is None
        self._keeper = keeper
        self.auto_rejoin = auto_rejoin

        self.config: JobConfig = self._wanted
        self.run: RunRecord | None = None
        self.keys: RunKeys | None = None
        self.member_id = ""
        self.incarnation = 0  # bumped each time this peer (re-)registers
        self._session: Session | None = None
        self._lock = threading.Lock()  # guards _session / member_id / error across threads
        self._acked: set[int] = set()
        self._alive_acked: set[int] = set()
        self._gen_seen_at: dict[int, float] = {}
        self._broken_seen_at: dict[int, float] = {}
        self._departure_seq = 0
        self._short_since: float | None = None
        self._seen_incarnation = -1  # last incarnation our own view has listed
        self._lost_lease = threading.Event()
        self.drain_requested = threading.Event()
        self.error: PeerElasticError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # What this coordination thread did (the training side counts in Peer.stats).
        self.stats = {"generations_written": 0, "cas_lost": 0, "rejoins": 0, "dropped": 0}
        # Lowered when etcd refuses a generation record as too large (a server started with
        # a --max-request-bytes below the default): the next plan caps the roster under it.
        self.roster_budget = ROSTER_BUDGET_BYTES
        self.events_kept = EVENTS_KEPT  # see EVENTS_KEPT
        self._pruned_at_count = -1

    # -- start ------------------------------------------------------------------------------------

    def start(self) -> Coordinator:
        """Join (or start) the job's run and start the coordination thread.

        Raises :class:`JobFinished` when the run already ended, :class:`ConfigError` when the
        settings differ from the run's, :class:`EtcdUnavailable` when etcd cannot be reached.
        """
        if self._keeper is None:
            self._keeper = LeaseKeeper(self.client, name=f"lease-keeper:{self.job}")
        self.view.start()
        try:
            self._register()
        except BaseException:
            self._shutdown_threads()
            raise
        self._thread = threading.Thread(
            target=self._coordination_loop, name=f"coordinator:{self.member_id}", daemon=True
        )
        self._thread.start()
        return self

    def _new_member_id(self) -> str:
        return f"{self.host}-{os.getpid()}-{secrets.token_hex(3)}"

    def _register(self) -> None:
        """Find or create the run, then put our member key under a fresh lease."""
        assert self._keeper is not None
        self._check_not_closed()
        session = Session(self.client, self._wanted.lease_ttl_s, self._keeper, self._on_lease_lost)
        member_id = self._new_member_id()
        try:
            for _attempt in range(20):
                run_kv = self.client.get(RunKeys(self.job, "x").run_key)
                self._check_not_closed()  # close() during a rejoin: register nothing
                if run_kv is None:
                    if self._create_run(session, member_id):
                        break
                    continue
                run = self._adopt_run(run_kv.value, run_kv.key)
                keys = RunKeys(self.job, run.run_id)
                done = self.client.get(keys.done)
                if done is not None:
                    self._raise_done(decode(DoneRecord, done.value, done.key))
                rec = self._member_record(member_id, session.lease_id)
                ok, _ = self.client.txn(
                    [Txn.mod(keys.run_key) == run_kv.mod_revision],
                    [Txn.put(keys.member(member_id), encode(rec), session.lease_id)],
                )
                if ok:
                    self._set_run(run)
                    break
            else:
                raise PeerElasticError(f"job {self.job!r}: the run record kept changing; "
                                       "could not register after 20 attempts")
        except BaseException:
            session.close(revoke=True)
            raise
        with self._lock:
            # close() and this registration race: whichever comes second under the lock
            # revokes the new lease (close() revokes the session it finds), so a closed
            # coordinator never leaves a member behind.
            closed = self._stop.is_set()
            if not closed:
                self._session = session
                self.member_id = member_id
                self.incarnation += 1
                self._lost_lease.clear()
        if closed:
            session.close(revoke=True)
            raise _Closed(f"job {self.job!r}: closed while registering; registration undone")
        assert self.run is not None
        self._keeper.keep(self.run.lease_id, self.config.run_ttl_s, self._on_run_lease_lost)
        log.info("joined job %s run %s as %s (lease %x)", self.job, self.run.run_id, member_id,
                 session.lease_id)
        self._event("joined", detail=f"host {self.host} pid {os.getpid()}")
        # Wait until our own watch shows us, so "am I a member" questions are answered.
        self.view.wait_for(lambda s: member_id in s.members, timeout=max(5.0, self.config.lease_ttl_s))

    def _check_not_closed(self) -> None:
        if self._stop.is_set():
            raise _Closed(f"job {self.job!r}: closed; not registering")

    def _create_run(self, session: Session, member_id: str) -> bool:
        cfg = self._wanted
        run_lease = self.client.grant(cfg.run_ttl_s)
        run = RunRecord(
            run_id=f"r{int(time.time())}-{secrets.token_hex(4)}",
            lease_id=run_lease,
            created_unix=time.time(),
            created_by=member_id,
        )
        run.config.CopyFrom(cfg)
        keys = RunKeys(self.job, run.run_id)
        rec = self._member_record(member_id, session.lease_id)
        data = encode(run)
        ok, resp = self.client.txn(
            [Txn.version(keys.run_key) == 0],
            [
                Txn.put(keys.run_key, data, run_lease),
                Txn.put(keys.member(member_id), encode(rec), session.lease_id),
            ],
            [Txn.get(keys.run_key)],
        )
        if not ok and _holds(resp, data):
            # The client retried a create whose answer was lost after etcd applied it: the
            # run there is ours (its id is fresh), not a rival's. Revoking the lease would
            # delete the run we just created, and any peer that joined it meanwhile.
            ok = True
        if not ok:
            self.client.revoke(run_lease)
            return False
        self._set_run(run)
        log.info("started run %s of job %s", run.run_id, self.job)
        return True

    def _adopt_run(self, data: bytes, key: str) -> RunRecord:
        try:
            run = decode(RunRecord, data, key)
        except RecordError as exc:
            raise ConfigError(
                f"job {self.job!r} has an unreadable run record ({exc}). If no peer of it is "
                f"running, delete it: etcdctl del --prefix {RunKeys(self.job, 'x').job_prefix}"
            ) from None
        self.settings.check_against(run.config, self.job, adopt=set(run.overridden))
        return run

    def _set_run(self, run: RunRecord) -> None:
        self.run = run
        self.keys = RunKeys(self.job, run.run_id)
        self.config = run.config

    def _member_record(self, member_id: str, lease_id: int) -> MemberRecord:
        rec = MemberRecord(
            member_id=member_id,
            host=self.host,
            address=self.address,
            pid=os.getpid(),
            local_rank=self.local_rank,
            lease_id=lease_id,
            version=__version__,
            started_unix=time.time(),
        )
        rec.labels.update(self.labels)
        return rec

    def _raise_done(self, done: DoneRecord) -> None:
        if not done.success and done.reason.startswith("reset limit"):
            raise ResetLimitExceeded(f"job {self.job!r} failed: {done.reason}")
        if not done.success and done.reason.startswith("elastic timeout"):
            raise ElasticTimeout(f"job {self.job!r} failed: {done.reason}")
        raise JobFinished(
            f"job {self.job!r} already finished "
            + ("successfully" if done.success else f"with failure: {done.reason}"),
            done.success,
            done.reason,
        )

    # -- lease loss -------------------------------------------------------------------------------

    def _on_lease_lost(self, lease_id: int, why: str) -> None:
        with self._lock:
            if self._session is None or self._session.lease_id != lease_id:
                return
            log.warning("member %s lost its lease: %s", self.member_id, why)
            self._lost_lease.set()
        self.view.wake()

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
        if gen is None or self.member_id not in gen.roster:
            return None
        return Assignment(gen.number, list(gen.roster).index(self.member_id), len(gen.roster),
                          tuple(gen.roster), self.member_id in gen.joined, gen.reason)

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
            self._raise_done(snap.done)
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
        if self.keys is None:
            return False
        rec = AckRecord(member_id=self.member_id, generation=generation, unix=time.time(),
                        detail=detail[:500])
        try:
            self.client.put(self.keys.broken(generation, self.member_id), encode(rec),
                            self.lease_id)
        except EtcdError as exc:
            log.warning("could not mark generation %d broken: %s", generation, exc)
            return False
        return True

    def request_leave(self, requested_by: str = "") -> None:
        """Ask to be drained: the next generation forms without this peer, with no rollback."""
        self.drain_requested.set()
        drain(self.client, self.job, self.member_id, requested_by or self.member_id)
        self.view.wait_for(lambda s: self.member_id in s.drains, timeout=self.config.lease_ttl_s)

    def record_progress(self, **fields: int) -> None:
        """Write the last committed position (rank 0 calls this; ``status`` shows it)."""
        assert self.keys is not None and self.run is not None
        rec = ProgressRecord(unix=time.time(), **fields)
        self.client.put(self.keys.progress, encode(rec), self.run.lease_id)

    def finish(self, success: bool = True, reason: str = "",
               timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Record the end of the run in ``done`` and return once etcd holds it.

        Create-if-absent, so any number of peers may call it (every rank does when training
        returns) and the first record stays. True if this call wrote it. While etcd does not
        answer it keeps trying for ``timeout_s``, then raises :class:`EtcdUnavailable`: a
        run whose end is not recorded would be trained again by the next peer to start.
        """
        assert self.keys is not None and self.run is not None
        snap = self.snapshot()
        rec = DoneRecord(success=success, reason=reason, written_by=self.member_id,
                         unix=time.time(), generation=snap.generation_number)
        data = encode(rec)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                created, existing = self.client.create(self.keys.done, data, self.run.lease_id)
                break
            except LeaseNotFound:
                raise PeerElasticError(
                    f"job {self.job!r}: the end of run {self.run.run_id} cannot be recorded: "
                    "its lease is gone (no peer kept it alive for run_ttl_s)") from None
            except EtcdUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise EtcdUnavailable(
                        f"job {self.job!r}: could not record that run {self.run.run_id} "
                        f"finished: etcd did not answer for {timeout_s:.0f} s ({exc}). Until "
                        "it is recorded, a peer that starts would train the job again.") from None
                log.warning("recording the end of the run: %s; retrying", exc)
                time.sleep(0.2)
        # Ours also when the client retried a create whose answer was lost: same bytes.
        created = created or (existing is not None and existing.value == data)
        if created:
            self._event("done", detail=("success" if success else "failure: " + reason))
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
            if leave and not self._lost_lease.is_set() and self.snapshot().done is None:
                self._mark_leaving()
            session.close(revoke=leave)
        if self.run is not None and self._keeper is not None:
            self._keeper.forget(self.run.lease_id, self._on_run_lease_lost)
        self._shutdown_threads()

    def _mark_leaving(self) -> None:
        """A deliberate exit is a graceful departure, not a failure: write our drain record
        (with the "left" event) before the lease goes, so the leader does not count it
        towards the blacklist or log it as expired."""
        if self.keys is None or self.run is None:
            return
        rec = DrainRecord(member_id=self.member_id, requested_by=self.member_id, unix=time.time())
        event = EventRecord(kind="left", member_id=self.member_id, unix=time.time(),
                            generation=self.snapshot().generation_number)
        try:
            self.client.txn([], [
                Txn.put(self.keys.drain(self.member_id), encode(rec), self.run.lease_id),
                Txn.put(self.keys.event(f"{time.time_ns():020d}-{self.member_id}"),
                        encode(event), self.run.lease_id),
            ])
        except EtcdError as exc:
            log.debug("could not mark %s as leaving: %s", self.member_id, exc)

    def _shutdown_threads(self) -> None:
        if self._own_keeper and self._keeper is not None:
            self._keeper.stop()
        self.view.stop()

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the coordination thread ------------------------------------------------------------------

    def _coordination_loop(self) -> None:
        version = -1
        wake_at: float | None = None
        while not self._stop.is_set():
            timeout = _TICK_S if wake_at is None else max(0.0, min(_TICK_S, wake_at - time.monotonic()))
            version = self.view.wait_change(
                version, timeout, until=lambda: self._stop.is_set() or self._lost_lease.is_set())
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
        gen = snap.generation
        if gen is not None:
            if gen.number not in self._gen_seen_at:
                self._gen_seen_at[gen.number] = now
                for table in (self._gen_seen_at, self._broken_seen_at):  # only n and n-1 matter
                    for old in [k for k in table if k < gen.number - 1]:
                        del table[old]
                self._acked &= {gen.number - 1, gen.number}
                self._alive_acked &= {gen.number - 1, gen.number}
            if self.member_id in gen.roster and gen.number not in self._acked:
                self._ack(gen.number)
            if snap.broken.get(gen.number):
                self._broken_seen_at.setdefault(gen.number, now)
                if self.member_id in gen.roster and gen.number not in self._alive_acked:
                    self._ack(gen.number, alive=True)  # proof of life after the break
        if self.member_id in snap.drains:
            self.drain_requested.set()
        self.config = snap.run.config
        return self._lead(snap, now)

    def _ack(self, n: int, alive: bool = False) -> None:
        assert self.keys is not None
        rec = AckRecord(member_id=self.member_id, generation=n, unix=time.time())
        key = self.keys.alive(n, self.member_id) if alive else self.keys.ready(n, self.member_id)
        self.client.put(key, encode(rec), self.lease_id)
        (self._alive_acked if alive else self._acked).add(n)

    def _rejoin(self) -> None:
        old = self.member_id
        if self._session is not None:
            self._session.close(revoke=True)  # the key may still exist if we merely stalled
        if not self.auto_rejoin:
            raise LeaseLost(f"member {old} lost its lease")
        self._acked.clear()
        self._alive_acked.clear()
        self._register()
        self.stats["rejoins"] += 1
        log.warning("member %s re-registered as %s after losing its lease", old, self.member_id)

    # -- leader duties ----------------------------------------------------------------------------

    def _lead(self, snap: ViewSnapshot, now: float) -> float | None:
        cfg = snap.run.config  # type: ignore[union-attr]
        eligible = snap.eligible()
        self._check_elastic_timeout(len(eligible), cfg, now)
        gen = snap.generation
        n = gen.number if gen else 0
        silent = silent_members(snap, self._gen_seen_at.get(n), cfg.join_timeout_s, now,
                                self._etcd_settled_at(), self._broken_seen_at.get(n))
        # The writer is the oldest eligible member that is not itself silent, so a silent
        # leader is replaced by the next-oldest.
        writer = next((m.id for m in eligible if m.id not in silent), None)
        if writer != self.member_id:
            self._departure_seq = snap.departures[-1].seq if snap.departures else 0
            return None
        self._count_failures(snap, cfg)
        self._prune_events(snap)
        plan = plan_next_generation(snap, cfg, silent, now, self.roster_budget)
        if isinstance(plan, Wait):
            if silent or gen is None or plan.until is not None:
                return plan.until
            # Look again when silence could start (see silent_members).
            floor = max(snap.connected_at, self._etcd_settled_at())
            deadlines = []
            seen = self._gen_seen_at.get(gen.number)
            if seen is not None and set(gen.roster) - snap.ready_for(gen.number):
                deadlines.append(max(seen, floor) + cfg.join_timeout_s)
            broke = self._broken_seen_at.get(gen.number)
            if broke is not None and set(gen.roster) - snap.alive_for(gen.number):
                deadlines.append(max(broke, floor) + cfg.join_timeout_s)
            return min(deadlines) if deadlines else None
        if cfg.reset_limit and plan.number - 1 > cfg.reset_limit:
            self._write_done(False, f"reset limit exceeded: {plan.number - 1} resets > "
                                    f"reset_limit={cfg.reset_limit}")
            return None
        self._write_generation(snap, plan, silent)
        return None

    def _prune_events(self, snap: ViewSnapshot) -> None:
        """Delete the oldest events beyond ``events_kept`` (keys sort by time).

        Unbounded, the log would outgrow what one read may carry and what etcd should hold.
        Runs when 10% over the cap, so it costs two requests per cap/10 events; not again
        until the view has seen the deletes (a stale count would delete too much).
        """
        keep = max(1, self.events_kept)
        count = snap.event_count
        if count <= keep + max(1, keep // 10) or count == self._pruned_at_count:
            return
        assert self.keys is not None
        prefix = self.keys.events_prefix
        oldest = self.client.first_keys(prefix, count - keep)
        if oldest:
            self.client.txn([], [Txn.delete_range(prefix, oldest[-1] + "\0")])
            log.info("event log: deleted the %d oldest events (keeping %d)", len(oldest), keep)
        self._pruned_at_count = count

    def _etcd_settled_at(self) -> float:
        """When etcd may be taken as settled again after the last disruption we saw: a
        member whose request stalled on the disruption has failed over by then."""
        if not self.client.disrupted_at:
            return 0.0
        return self.client.disrupted_at + 2 * self.client.timeout_s

    def _check_elastic_timeout(self, available: int, cfg: JobConfig, now: float) -> None:
        if available >= cfg.min_np:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since = now
        elif now - self._short_since > cfg.elastic_timeout_s:
            # The run fails as a whole: record it (the first writer wins), so peers that
            # systemd restarts, and late joiners, see a failed job instead of waiting again.
            self._write_done(False, f"elastic timeout: fewer than min_np={cfg.min_np} peers "
                                    f"for {cfg.elastic_timeout_s:.0f} s")
            raise ElasticTimeout(
                f"job {self.job!r}: only {available} of min_np={cfg.min_np} peers were "
                f"available for {cfg.elastic_timeout_s:.0f} s (elastic timeout); giving up. "
                "Start more peers, or lower min_np / raise PEER_ELASTIC_ELASTIC_TIMEOUT."
            )

    def _write_generation(self, snap: ViewSnapshot, plan: GenerationPlan,
                          silent: Mapping[str, str] | None = None) -> None:
        assert self.keys is not None and self.run is not None
        keys, run_lease = self.keys, self.run.lease_id
        now_unix = time.time()
        if plan.broken or plan.dropped:
            detected = now_unix  # acted on the moment it was seen
        else:  # a join or leave, batched for settle_s: it happened when membership changed
            detected = now_unix - max(0.0, time.monotonic() - snap.membership_changed_at)
        rec = GenerationRecord(
            number=plan.number, roster=list(plan.roster), reason=plan.reason,
            needs_sync=plan.needs_sync, written_by=self.member_id, written_unix=now_unix,
            joined=list(plan.joined), removed=list(plan.removed), detected_unix=detected,
        )
        # The ack each dropped member failed to give must still be absent: if it arrives
        # first, the drop is wrong and the write fails.
        n = plan.number - 1
        guards = [Txn.version(keys.alive(n, m) if (silent or {}).get(m) == "alive"
                              else keys.ready(n, m)) == 0 for m in plan.dropped]
        ops = [
            Txn.put(keys.event(f"{time.time_ns():020d}-{self.member_id}"), encode(EventRecord(
                kind="generation", member_id=self.member_id, generation=plan.number,
                detail=plan.reason, unix=time.time())), run_lease),
        ]
        if plan.number >= 3:  # two behind: nobody can still be forming it
            ops.append(Txn.delete(keys.gen_prefix(plan.number - 2), prefix=True))
        # Dropped members' keys go in the same transaction: were they to outlive the new
        # generation by even one event, the next pass would see a live member outside the
        # roster and re-admit it as a newcomer. (Their leases are revoked right after.)
        ops += [Txn.delete(keys.member(m)) for m in plan.dropped]
        # Drain records of members already gone (bounded: etcd allows 128 ops per txn).
        ops += [Txn.delete(keys.drain(m)) for m in sorted(snap.drains)
                if m not in snap.members][:20]
        data = encode(rec)
        mod = snap.generation_mod_revision
        try:
            ok, resp = self.client.txn(
                [Txn.version(keys.generation) == 0 if mod == 0
                 else Txn.mod(keys.generation) == mod,
                 # Only a member writes: a leader whose lease ended after it decided (its
                 # key is gone, others may already lead) must not install a roster.
                 Txn.version(keys.member(self.member_id)) > 0,
                 *guards],
                [Txn.put(keys.generation, data, run_lease), *ops],
                [Txn.get(keys.generation)],
            )
        except EtcdRequestTooLarge as exc:
            self._shrink_roster_budget(plan, exc)
            return
        if not ok and _holds(resp, data):
            ok = True  # our write applied; the client retried it after losing the answer
        if not ok:
            self.stats["cas_lost"] += 1
            log.debug("generation %d: another writer won", plan.number)
            return
        self.stats["generations_written"] += 1
        log.info("generation %d: %d members (%s)", plan.number, len(plan.roster), plan.reason)
        for m in plan.dropped:
            member = snap.members.get(m)
            if member is not None:
                self.stats["dropped"] += 1
                self.client.revoke(member.record.lease_id)

    def _shrink_roster_budget(self, plan: GenerationPlan, exc: EtcdRequestTooLarge) -> None:
        """etcd refused generation ``plan`` as too large: halve the roster budget, so the
        next plan leaves the rest as standbys, or fail clearly if the roster is minimal."""
        size = roster_bytes(plan.roster)
        cfg = self.config
        if len(plan.roster) <= max(1, cfg.min_np):
            raise PeerElasticError(
                f"etcd refused generation {plan.number} of {len(plan.roster)} members as too "
                f"large ({exc}); even min_np={cfg.min_np} members do not fit. Raise etcd's "
                "--max-request-bytes (default 1.5 MiB).")
        self.roster_budget = min(self.roster_budget, size) // 2
        msg = (f"etcd refused generation {plan.number} of {len(plan.roster)} members "
               f"({size} bytes of member ids) as too large; the roster is capped at "
               f"{self.roster_budget} bytes from now on, the other members wait as standbys. "
               "Raise etcd's --max-request-bytes to admit them.")
        log.error("%s", msg)
        self._event("generation too large", detail=msg)

    def _write_done(self, success: bool, reason: str) -> None:
        assert self.keys is not None and self.run is not None
        rec = DoneRecord(success=success, reason=reason, written_by=self.member_id,
                         unix=time.time(), generation=self.snapshot().generation_number)
        created, _ = self.client.create(self.keys.done, encode(rec), self.run.lease_id)
        if created:
            log.error("job %s failed: %s", self.job, reason)

    def _count_failures(self, snap: ViewSnapshot, cfg: JobConfig) -> None:
        """Count non-graceful departures per host; blacklist a host past the threshold."""
        fresh = [d for d in snap.departures if d.seq > self._departure_seq]
        if snap.departures:
            self._departure_seq = snap.departures[-1].seq
        for d in fresh:
            if not d.graceful:
                self._event("expired", member_id=d.member_id,
                            detail=f"host {d.host}: lease ended without a graceful leave")
        if not cfg.blacklist_after:
            return
        assert self.keys is not None and self.run is not None
        for d in fresh:
            if d.graceful:
                continue
            prev, mod = snap.failures.get(d.host, (None, 0))
            count = (prev.failures if prev else 0) + 1
            rec = HostRecord(host=d.host, failures=count, unix=time.time(),
                             reason=f"member {d.member_id} failed")
            if count >= cfg.blacklist_after:
                lease = self.client.grant(cfg.blacklist_cooldown_s)
                self.client.txn([], [
                    Txn.put(self.keys.blacklist(d.host), encode(rec), lease),
                    Txn.delete(self.keys.failures(d.host)),
                ])
                self._event("blacklisted", detail=f"{d.host}: {count} failures; excluded for "
                                                  f"{cfg.blacklist_cooldown_s:.0f} s")
            else:
                self.client.compare_and_put(self.keys.failures(d.host), encode(rec), mod,
                                            self.run.lease_id)

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None, timings: Mapping[str, float] | None = None,
                     ) -> None:
        """Append to the run's event log (best effort: a lost event is logged, not raised)."""
        if self.keys is None or self.run is None:
            return
        rec = EventRecord(kind=kind, member_id=member_id or self.member_id, detail=detail,
                          unix=time.time(),
                          generation=generation or self.snapshot().generation_number)
        rec.timings_s.update(timings or {})
        try:
            self.client.put(self.keys.event(f"{time.time_ns():020d}-{self.member_id}"),
                            encode(rec), self.run.lease_id)
        except EtcdError as exc:
            log.debug("event not recorded: %s", exc)

    def _event(self, kind: str, detail: str = "", member_id: str | None = None) -> None:
        self.record_event(kind, detail, member_id)


def _holds(resp: list, data: bytes) -> bool:
    """Whether a failed transaction's read (``resp[0]``, one key) found exactly ``data``:
    a value this peer just encoded (it has a fresh id or time stamp), so its own write."""
    return bool(resp and resp[0] and resp[0][0].value == data)


def drain(client: EtcdClient, job: str, member_id: str, requested_by: str = "operator") -> None:
    """Ask ``member_id`` to leave gracefully (what ``peer-elastic drain`` does)."""
    run_kv = client.get(RunKeys(job, "x").run_key)
    if run_kv is None:
        raise ConfigError(f"job {job!r} has no running run")
    run = decode(RunRecord, run_kv.value, run_kv.key)
    keys = RunKeys(job, run.run_id)
    if not valid_name(member_id) or client.get(keys.member(member_id)) is None:
        raise ConfigError(f"job {job!r} has no member {member_id!r} (see peer-elastic status)")
    rec = DrainRecord(member_id=member_id, requested_by=requested_by, unix=time.time())
    event = EventRecord(kind="drain requested", member_id=member_id, unix=time.time(),
                        detail=f"by {requested_by}")
    client.txn([], [
        Txn.put(keys.drain(member_id), encode(rec), run.lease_id),
        Txn.put(keys.event(f"{time.time_ns():020d}-{member_id}"), encode(event), run.lease_id),
    ])


#: Settings that can change while a job runs. Lease TTLs cannot: leases are already granted.
RUNTIME_SETTINGS = frozenset({
    "min_np", "max_np", "join_timeout_s", "elastic_timeout_s", "reset_limit", "blacklist_after",
    "blacklist_cooldown_s", "settle_s", "start_settle_s", "paused",
    "hang_timeout_s",  # read from the watched run record at every look of the hang detector
})


def update_config(client: EtcdClient, job: str, changes: Mapping[str, object],
                  requested_by: str = "operator") -> JobConfig:
    """Change settings of a running job (``peer-elastic set``, ``pause``, ``resume``).

    Peers read the settings from the watched run record, so the change takes effect at
    their next step, with no restart. Compare-and-swap on the run record; retried when a
    peer or another operator changed it meanwhile.
    """
    from peer_elastic.config import JOB_FIELDS, validate

    kinds = {f.name: f.kind for f in JOB_FIELDS} | {"paused": bool}
    for name in changes:
        if name not in kinds:
            raise ConfigError(f"unknown setting {name!r}; settable: {sorted(RUNTIME_SETTINGS)}")
        if name not in RUNTIME_SETTINGS:
            raise ConfigError(f"{name} cannot change while the job runs (leases already hold it)")
    run_key = RunKeys(job, "x").run_key
    for _attempt in range(10):
        kv = client.get(run_key)
        if kv is None:
            raise ConfigError(f"job {job!r} has no running run")
        run = decode(RunRecord, kv.value, kv.key)
        for name, value in changes.items():
            kind = kinds[name]
            try:
                if kind is bool and isinstance(value, str):
                    parsed: object = value.lower() in ("1", "true", "yes", "on")
                else:
                    parsed = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name}={value!r} is not a valid {kind.__name__}") from None
            setattr(run.config, name, parsed)
            if name not in run.overridden:
                run.overridden.append(name)
        validate(run.config)
        keys = RunKeys(job, run.run_id)
        detail = ", ".join(f"{k}={getattr(run.config, k)}" for k in changes)
        event = EventRecord(kind="settings changed", unix=time.time(),
                            detail=f"{detail} (by {requested_by})")
        ok, _ = client.txn([Txn.mod(run_key) == kv.mod_revision], [
            Txn.put(run_key, encode(run), run.lease_id),
            Txn.put(keys.event(f"{time.time_ns():020d}-operator"), encode(event), run.lease_id),
        ])
        if ok:
            return run.config
    raise PeerElasticError(f"job {job!r}: the run record kept changing; settings not applied")
