"""The elastic run loop: Horovod Elastic semantics on top of the coordination core.

:class:`Peer` owns the per-step protocol (in the manner of torchft's ``Manager``); the
process group it reconfigures lives in :mod:`peer_elastic.torch.group`, the membership in
:mod:`peer_elastic.etcd.coordinator`.

One pass of :meth:`Peer.run`::

    form the group of the newest generation listing us  (standbys wait here)
    -> reset callbacks on every rank (they see the new world size and may use collectives)
    -> agree on state: one all-gather of every rank's (needs state?, state version); sync
       from the lowest rank holding the newest version unless all hold the same one
       (peer_elastic.agreement)
    -> call the training function
         HostsUpdatedInterrupt -> keep live state, back to the top
         a failed collective   -> restore the last commit, mark the generation broken,
                                  back to the top
         it returns            -> every rank records `done` (the first write stays) and
                                  returns the result once etcd holds it

``check_host_updates()`` (also inside ``commit()``) does no etcd I/O: it reads the watched
generation from memory and exchanges it in a tiny all-reduce issued at one check and
completed at the next (a commit's is blocking), so every roster member raises
``HostsUpdatedInterrupt`` at the same call; progress recorded on one rank only is merged
before a commit is saved and before the interrupt (see :meth:`Peer._check`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from peer_elastic import logs, threads
from peer_elastic.agreement import Agreement, Claim, StateVersion
from peer_elastic.durable.service import DurableSnapshots
from peer_elastic.durable.writer import SnapshotInfo
from peer_elastic.errors import (
    HostsUpdatedInterrupt,
    LeaveRequested,
    PeerElasticError,
    ShardedStateLost,
)
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.stop import RESET_NOW, stop_reason
from peer_elastic.liveness import TrainingWatch
from peer_elastic.lost_state import StateMarker, lost_state
from peer_elastic.memo import IdentityMemo
from peer_elastic.observer import NoObserver, PeerStats, StepObserver, observed
from peer_elastic.sharded.durable import ShardedSnapshots
from peer_elastic.sharded.regroup import regroup
from peer_elastic.sharded.state import ShardedState
from peer_elastic.straggler.watch import StragglerWatch
from peer_elastic.torch.abort import HangWatchdog
from peer_elastic.torch.check_cadence import CheckCadence
from peer_elastic.torch.collectives import agree_and_sync
from peer_elastic.torch.group import FormedGroup, GroupManager, is_collective_failure
from peer_elastic.torch.max_exchange import MaxExchange
from peer_elastic.torch.pending_check import PendingCheck
from peer_elastic.torch.reset_vote import Ballot, ResetVote, voting

log = logging.getLogger(__name__)

R = TypeVar("R")


class Peer:
    """A training process's membership in an elastic job. Create it with :func:`peer_elastic.join`."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        backend: str = "auto",
        collective_timeout_s: float = 30.0,
        rendezvous_timeout_s: float = 120.0,
        metrics: StepObserver | None = None,
        abandon_hung_collectives: bool = True,
    ) -> None:
        self.coordinator = coordinator
        self.stats = PeerStats()  # what the parts below report (collectives abandoned, ...)
        self.groups = GroupManager(coordinator, backend, collective_timeout_s,
                                   rendezvous_timeout_s, stats=self.stats)
        # Frees this peer from a collective stuck on a peer whose lease is gone, after giving
        # the training thread join_timeout to leave the group by itself.
        self._watchdog: HangWatchdog[FormedGroup] | None = None
        if abandon_hung_collectives:
            self._watchdog = HangWatchdog(self.groups, coordinator.view)
        # Training-thread liveness (peer_elastic.liveness): a training thread stuck in its own
        # code for hang_timeout_s makes this peer dump its stacks, fence itself and exit.
        # A collective that waits long makes the group manager check it can still reach
        # its peers: a peer cut off from them (not from etcd) keeps its lease.
        self._liveness = TrainingWatch(coordinator, lambda: self.generation,
                                       on_waiting=self.groups.waited_on_peers)
        self._group: FormedGroup | None = None
        self._incarnation = coordinator.incarnation
        self._check_exchange: MaxExchange | None = None
        # The generation exchange a plain check issued, completed at the next check that
        # exchanges: every check, or every P-th when checks come fast (check_cadence).
        self._pending = PendingCheck()
        self._cadence = CheckCadence()
        # Or, in a job averaging gradients with DistributedOptimizer, the same bit carried by
        # the step's gradient all-reduce: then a check runs no collective of its own.
        self._vote = ResetVote(self._ballot)
        # What this rank wants (generation, vote), decided once per change of its facts.
        self._wants: IdentityMemo[tuple[int, Ballot]] = IdentityMemo()
        self._state: Any = None  # the state given to run()
        self._synced_once = False
        self._restored = False  # since the last reset (for metrics)
        # The version of the live state and of the last commit (peer_elastic.agreement).
        self._live = StateVersion()
        self._committed = StateVersion()
        self.resets = 0
        self.last_reset_s = 0.0
        self.reset_log: list[dict[str, Any]] = []
        self._pending_timing: dict[str, Any] | None = None
        self._progress = _Publisher(coordinator)
        # Rank 0 says in etcd that the state has commits (peer_elastic.lost_state).
        self._marker = StateMarker(self._progress.offer_state)
        # peer_elastic.metrics.PeerMetrics, or None when off (a NoopMetrics is falsy): then
        # nothing wraps the per-step check, and the other hooks go to a NoObserver.
        self.metrics = metrics if metrics else None
        self._observer: StepObserver = self.metrics or NoObserver()
        self._observer.bind(self)
        # Durable snapshots (peer_elastic.durable), when the job has a snapshot_dir: rank 0
        # writes one in the background at a due commit; a group in which nobody holds
        # committed state resumes from the newest.
        self.snapshots = DurableSnapshots.for_job(getattr(coordinator, "config", None),
                                                  coordinator.job, self.stats,
                                                  getattr(coordinator, "client", None),
                                                  hang_exempt=self._liveness.exempt)
        # A ShardedState's snapshots: every rank writes its rows (made at its first group).
        self._sharded_snapshots: ShardedSnapshots | None = None
        # This peer's pace between checks, exchanged about once a second; a straggler says
        # so and, under straggler_policy=evict, leaves (peer_elastic.straggler).
        self.straggler = StragglerWatch(coordinator)

    # -- what the user reads ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._group.assignment.rank if self._group else -1

    @property
    def size(self) -> int:
        return self._group.assignment.size if self._group else 0

    @property
    def generation(self) -> int:
        return self._group.assignment.generation if self._group else 0

    @property
    def member_id(self) -> str:
        return self.coordinator.member_id

    @property
    def local_rank(self) -> int:
        """This process's slot on its host, fixed for its whole life: the device to use.

        Unlike :attr:`rank`, which changes over resets. :func:`peer_elastic.join` reads it
        from ``PEER_ELASTIC_LOCAL_RANK`` (``peer-elastic run``, the systemd unit), else
        torchrun's ``LOCAL_RANK``, else Slurm's ``SLURM_LOCALID``; 0 when none is set."""
        return self.coordinator.local_rank

    @property
    def is_leader(self) -> bool:
        return self.coordinator.is_leader

    @property
    def device(self) -> torch.device:
        """Where collective buffers of this peer's backend live."""
        if self.groups.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- the protocol -----------------------------------------------------------------------------

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank at once if membership changed.

        The same check as ``state.check_host_updates()`` on the state given to :meth:`run`.
        """
        self._check(self._state, committing=False)

    def _check(self, state: Any, committing: bool) -> None:
        """The per-step protocol behind ``state.commit()`` and ``state.check_host_updates()``.

        No etcd I/O: the newest generation comes from the watched view in memory.

        A plain check completes the generation exchange the previous check issued
        (:mod:`peer_elastic.torch.pending_check`) and issues the next one, so it waits on
        nobody unless a rank is behind: every rank completes the same op at the same call
        and so decides the same there, one check after a rank first saw the change. When
        checks come faster than an exchange is worth, only every P-th plain check exchanges
        (P agreed by the exchange, the same on every rank; at most 20 ms of checks,
        :mod:`peer_elastic.torch.check_cadence`); the others return at once. When a
        ``DistributedOptimizer`` step (or a DDP backward pass with ``pe.allreduce_hook``) ran
        since the last check, its gradient all-reduce already carried the same bit
        (:mod:`peer_elastic.torch.reset_vote`): the check takes that and issues nothing, so
        it runs no collective at all (but for the exchange of paces, about once a second, at
        the top: :mod:`peer_elastic.straggler`).

        A commit, and a plain check whose completed exchange says a reset is due, need to
        know whether some rank holds unmerged progress *now*: they run one blocking
        all-reduce (MAX) of [the newest generation I know of, do I hold unmerged progress].
        Then, in this order: merge the progress some rank recorded only locally (only when
        some rank has such progress), save the commit, raise if a new generation is pending.
        A rank whose collective fails never gets to save or keep the step: it restores its
        last commit, whose progress was merged (see ``peer_elastic.agreement``).
        """
        group = self._group
        if group is None:
            if committing:
                state.record_commit()
            return
        self._liveness.stepped()
        if self.straggler.at_check(group):  # every rank at the same checks, about 1/s
            with self._liveness.collective():
                self.straggler.exchange(group, self.device)
        if self.groups.has_unmarked_connections:  # a subgroup the training function made
            self.groups.keep_connections_from_exec()
        if self._pending_timing is not None:
            self._publish_timing()
        current = group.assignment.generation
        self._live = self._live.stepped(current)
        # The vote of the optimizer steps since the last check, the same on every rank.
        voted = self._vote.take(group)
        if voted is False and not committing and not self._pending.pending:
            return  # the step's gradient all-reduce said: nobody wants a reset
        if voted is None and not committing and self._pending.pending \
                and not self._cadence.due():
            self.stats.count("checks_spaced")
            return  # between two exchanges: the same calls on every rank (check_cadence)
        exchange_t0 = time.perf_counter()
        snap = self.coordinator.snapshot()
        want = self._wanted(group, snap)[0]
        # Complete the op of the previous check first (also before a commit), so every rank
        # runs the same collectives in the same order.
        with self._liveness.collective():  # waiting here is waiting on the others
            previous = self._pending.complete(group)
        reset_due = previous is not None and previous.newest_generation > current
        reset_due = reset_due or bool(voted)
        if not committing and not reset_due:
            if voted is None:  # no step carried the bit: exchange it ourselves
                self.stats.count("check_exchanges")
                self._pending.issue(group, want, self.device, self._cadence.proposal())
                self._cadence.exchanged(time.perf_counter() - exchange_t0,
                                        previous.period if previous is not None else 1)
            return
        local = state is not None and state.has_local_progress()
        exchange = self._check_exchange
        if exchange is None or exchange.device != self.device:
            exchange = self._check_exchange = MaxExchange(2, self.device)
        with self._liveness.collective():
            newest_wanted, someone_local = exchange.run((want, int(local)))
        reset, merge = newest_wanted > current, bool(someone_local)
        reset = reset or reset_due
        if merge and state is not None:
            with self._liveness.collective():
                state.merge_progress()
        if committing:
            if isinstance(state, ShardedState):
                state.expect_save(self._live.committed())  # its shards carry their version
            state.record_commit()
            self._live = self._committed = self._live.committed()
            if group.assignment.rank == 0:
                self._marker.committed(self._committed.commits, group.generation)
                if self.snapshots is not None and not isinstance(state, ShardedState):
                    self.snapshots.after_commit(state, self._snapshot_info(self._committed))
            if isinstance(state, ShardedState) and self._sharded_snapshots is not None:
                # every rank writes its rows: all decide together, right after the commit
                with self._liveness.collective():
                    self._sharded_snapshots.after_commit(
                        state, self._snapshot_info(self._committed), self.device)
        if reset:
            newest = snap.generation
            removals_only = newest is not None and not newest.joined
            raise HostsUpdatedInterrupt(skip_sync=removals_only)

    def _want(self, group: FormedGroup, snap: Any) -> int:
        """The generation this rank asks the group to move to (the current one: none)."""
        current = group.assignment.generation
        newest = snap.generation
        want = newest.number if newest is not None else current
        if stop_reason(self.coordinator, group, snap, causes=RESET_NOW) is not None:
            # Lease lost (we must not go on in this group), a fatal error, or the job ended
            # (e.g. reset limit): everyone stops at the next check and the reset path reports it.
            want = max(want, current + 1)
        return want

    def _wanted(self, group: FormedGroup, snap: Any) -> tuple[int, Ballot]:
        """``_want(group, snap)``, and the reset vote it makes.

        Asked at every check and every optimizer step. It depends only on the group, the
        watched view's snapshot, the coordinator's fatal error and its registration (what
        ``_want`` reads), so while those are the same objects the last answer stands
        (:mod:`peer_elastic.memo`): deciding it anew walked the stop causes every step.
        """
        coord = self.coordinator
        facts = (group, snap, coord.error, coord.incarnation)
        wanted = self._wants.get(facts)
        if wanted is None:
            want = self._want(group, snap)
            wanted = self._wants.put(facts, (want, Ballot(group, want > group.generation)))
        return wanted

    def _ballot(self) -> Ballot | None:
        """This rank's reset vote for an optimizer step's gradient all-reduce."""
        group = self._group
        return None if group is None else self._wanted(group, self.coordinator.snapshot())[1]

    def run(self, func: Callable[..., R], state: Any, *args: Any, **kwargs: Any) -> R:
        """Run ``func(state, *args, **kwargs)`` elastically until it returns.

        Returns its result on every peer. A peer that was asked to leave (SIGTERM, drain)
        raises ``SystemExit(0)`` once the job re-formed without it; one evicted as a
        straggler (``straggler_policy=evict``), ``SystemExit(7)``. A peer that finds the
        job finished raises :class:`JobFinished` (``join`` turns it into exit code 0, or 4
        when the job failed).
        """
        self._state = state
        # commit() and check_host_updates() go through _check; timed when observed.
        state.attach(self._check if self.metrics is None else observed(self._check, self._observer))
        if self._watchdog is not None:
            self._watchdog.start()
        self._liveness.start()
        after = 0
        try:
            while True:
                try:
                    self._reset(state, after)
                    # only time in training() can be a hang; voting(): optimizer steps carry
                    # the reset vote (peer_elastic.torch.reset_vote)
                    with self._liveness.training(), voting(self._vote):
                        result = func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    log.info("hosts updated%s: resetting", " (removals only)" if exc.skip_sync else "")
                    after = self.generation
                    if isinstance(state, ShardedState):
                        try:
                            self._hand_off(state)
                        except Exception as failure:
                            if not is_collective_failure(failure):
                                raise
                            self._on_collective_failure(state, failure)
                    continue
                except ShardedStateLost as exc:
                    self._fail_job(exc)
                    raise
                except PeerElasticError:
                    raise
                except Exception as exc:
                    if self._group is None or not is_collective_failure(exc):
                        raise
                    self._on_collective_failure(state, exc)
                    after = self.generation
                    continue
                self._finish()
                return result
        except LeaveRequested as exc:
            self._final_snapshot(state)
            self._leave(str(exc))
            code = self.straggler.exit_code
            if code:
                print(f"peer-elastic: {self.member_id} left job {self.coordinator.job!r} as a "
                      f"straggler (straggler_policy=evict); exit status {code}, so that its "
                      "host can be replaced", file=sys.stderr, flush=True)
            raise SystemExit(code) from None
        finally:
            state.attach(None)
            self._state = None

    def _hand_off(self, state: ShardedState) -> None:
        """The group is about to be replaced and still works: save the live sharded state
        with every leaving rank's shard copied to ranks that stay (a leaver's shard must
        outlive it; a joiner gets its rows from the holders when the next group forms)."""
        snap = self.coordinator.snapshot()
        newest = snap.generation
        leaving = newest is not None and newest.number > self.generation \
            and self.coordinator.member_id not in snap.roster_ids()
        with self._liveness.collective():
            state.hand_off(self._live, leaving)
        self._committed = self._live

    def _fail_job(self, exc: ShardedStateLost) -> None:
        """Sharded state lost beyond what memory and disk hold: say so (the ``state_lost``
        event and metric) and end the run as failed, so that standbys and late peers stop
        too instead of training from the initial weights."""
        log.error("%s", exc)
        self.stats.count("states_lost")
        if self.rank == 0:
            self._progress.offer_event("state_lost", str(exc)[:500], self.generation, {})
        try:
            self.coordinator.finish(False, "sharded state lost")
        except PeerElasticError as e:
            log.warning("could not record the failed end of the run: %s", e)

    def _on_collective_failure(self, state: Any, exc: Exception) -> None:
        """A peer died mid-collective: roll back to the last commit and tell the leader."""
        log.warning("collective failed in generation %d: %s; restoring the last commit",
                    self.generation, exc)
        self._pending.drop()  # its group is broken: never wait on its op
        self._restore(state)
        self.coordinator.mark_broken(self.generation, str(exc)[:300])  # best effort, logged

    def _reset(self, state: Any, after: int) -> None:
        t0 = time.monotonic()
        first = self._group is None and after == 0
        restored, incarnation = self._restored, self._incarnation  # how we got here, for metrics
        self._pending.drop()  # the old group's op dies with it, never waited on in the next
        self._vote.clear()
        while True:
            try:
                self._group = self.groups.form(after)
                formed_unix = time.time()
                self._incarnation = self.coordinator.incarnation
                # State first, then the reset callbacks, on EVERY rank (joiners and the
                # first generation included): callbacks may run collectives, such as
                # rebuilding DDP, and all ranks must enter them together. After the sync,
                # because DDP's constructor broadcasts rank 0's parameters: run before it,
                # that overwrote the newest state whenever its holder was not rank 0 (an
                # older peer back from a partition), and the sync then sent rank 0's old
                # model with the holder's newer progress (a seeded soak lost 288 samples).
                # Waits on the others (marked: a peer cut off meanwhile is probed for).
                with self._liveness.collective():
                    self._agree_and_sync(state)
                    state.on_reset()
                # Once the callbacks made their subgroups (the group's own connections were
                # marked when it formed): no program the training function runs (os.system)
                # may hold this peer's connections past its death.
                if self.groups.has_unmarked_connections:
                    self.groups.keep_connections_from_exec()
                self._pending_timing = {"formed": formed_unix, "synced": time.time(),
                                        "gen": self.coordinator.latest_generation}
                break
            except PeerElasticError:
                raise
            except Exception as exc:  # a peer died while we were forming or syncing
                if not is_collective_failure(exc):
                    raise
                log.warning("generation %d failed while forming: %s", self.generation, exc)
                # A sync cut short may have overwritten part of the live state: go back to
                # the last commit (intact: a sync only writes it after completing), so this
                # rank never serves a torn state as the next sync source.
                self._restore(state)
                if self._group is not None:
                    self.coordinator.mark_broken(self.generation, str(exc)[:300])
                    after = self.generation
                self._group = None
        took = time.monotonic() - t0
        if not first:
            self.resets += 1
            self.last_reset_s = took
        a = self._group.assignment
        logs.set_context(member=self.coordinator.member_id, rank=a.rank, generation=a.generation)
        self.reset_log.append({"generation": a.generation, "rank": a.rank, "size": a.size,
                               "seconds": took, "reason": a.reason})
        if not first:
            self._observer.on_reset(a.causes, took, crashed=restored,
                                    lease_lost=self._incarnation != incarnation)
        log.info("generation %d ready: rank %d of %d in %.3f s", a.generation, a.rank, a.size, took)

    def _restore(self, state: Any) -> None:
        """Back to the last commit, and to its version."""
        state.restore()
        self._live = self._committed
        self._restored = True

    def _agree_and_sync(self, state: Any) -> None:
        assert self._group is not None
        # Joiners and returning members (the generation's `joined`) always take state, even
        # when their version matches: it costs one sync and relies on nothing they kept.
        need = not self._synced_once or self._group.assignment.joined
        t0 = time.perf_counter()
        if isinstance(state, ShardedState):
            agreement, looked = self._regroup(state, need)
            self._agreed(agreement, t0, looked)
            return
        resume_from_snapshot = None
        newest_snapshot = None
        if self.snapshots is not None:
            resume_from_snapshot = self.snapshots.resumer(state, self.generation, self.device)
            newest_snapshot = self.snapshots.newest_version()
        resumed = False

        def resume(claims: Sequence[Claim]) -> Agreement | None:
            # agree_and_sync calls this on every rank exactly when no rank holds trained
            # state (the first group of a run, or every holder lost), or when a snapshot is
            # newer than every version held (peer_elastic.lost_state says what was lost).
            nonlocal resumed
            resumed = True
            return resume_from_snapshot(claims) if resume_from_snapshot is not None else None

        claim = Claim(self._live, need, newest_snapshot, time.time_ns())
        agreement = agree_and_sync(state, claim, self.device, resume, committed=self._committed)
        self._agreed(agreement, t0, resumed)

    def _agreed(self, agreement: Agreement, t0: float, resumed: bool) -> None:
        """What every new group does once its state is agreed (``resumed``: it looked for a
        durable snapshot)."""
        if agreement.source is not None:
            self._observer.on_sync(time.perf_counter() - t0)
        self._report_lost_state(agreement.version, held=not resumed)
        self._live = agreement.version
        if agreement.source is not None:
            # The sync saved what every rank now holds as the restore point. A skipped sync
            # saved nothing: the restore point is still the last commit, and its version must
            # stay that commit's, or a restore would name the live state it no longer holds.
            self._committed = agreement.version
        self._synced_once = True
        self._restored = False

    def _regroup(self, state: ShardedState, need: bool) -> tuple[Agreement, bool]:
        """The sharded state's agreement: reshard in memory, load a snapshot, or start."""
        durable = self._sharded_snapshots
        if durable is None and self.snapshots is not None:
            durable = self._sharded_snapshots = ShardedSnapshots(self.snapshots)
        newest = durable.newest_version() if durable is not None else None
        claim = Claim(self._live, need, newest, time.time_ns())
        generation, device = self.generation, self.device

        def resume(claims: Sequence[Claim]) -> Agreement | None:
            assert durable is not None
            return durable.resume(state, claims, generation, device)

        result = regroup(state, claim, device, generation,
                         resume if durable is not None else None)
        if durable is not None:
            durable.regrouped()  # a writer on a gloo group of this generation's own
        return result

    def _report_lost_state(self, agreed: StateVersion, held: bool) -> None:
        """A group formed that goes on from a resumed snapshot, from the initial state, or
        (``held``) from an in-memory version older than the run's state had: if the run's
        state had more commits, say loudly that they were lost and where training goes on
        from. Never a silent rollback."""
        lost = lost_state(self.coordinator.snapshot().state, agreed, held=held)
        if lost is None:
            return  # the first group of a run, or nothing lost
        what = lost.describe()
        log.error("%s", what)
        self.stats.count("states_lost")
        if self.rank == 0:
            self._progress.offer_event("state_lost", what, self.generation, {})

    def _final_snapshot(self, state: Any) -> None:
        """Leaving on purpose (SIGTERM, drain) as rank 0 of the last group: write a durable
        snapshot of the live state (a consistent version: the interrupt merged progress
        first), so stopping the whole job gracefully loses nothing. Rank 0 alone leaving
        writes one too: it cannot know whether anyone goes on, and it costs one write."""
        if self.snapshots is None or self._group is None or self._group.assignment.rank != 0:
            return
        if isinstance(state, ShardedState):
            return  # every rank writes its shard; a leaver's shard went to the ranks that stay
        if self.snapshots.final(state, self._snapshot_info(self._live)):
            log.warning("final snapshot written before leaving")
        else:
            log.warning("final snapshot not written (see above)")

    def _snapshot_info(self, version: StateVersion) -> SnapshotInfo:
        run = getattr(self.coordinator, "run", None)
        return SnapshotInfo(run.run_id if run is not None else "", self.generation, self.size,
                            version)

    def _publish_timing(self) -> None:
        """At the first step after a reset: rank 0 logs where the recovery time went."""
        t, self._pending_timing = self._pending_timing, None
        gen = t["gen"] if t else None
        if self.rank != 0 or gen is None or gen.number != self.generation:
            return
        first_step = time.time()
        detected = gen.detected_unix or gen.written_unix
        timings = {
            "detected_to_written": gen.written_unix - detected,
            "written_to_formed": t["formed"] - gen.written_unix,
            "formed_to_synced": t["synced"] - t["formed"],
            "synced_to_first_step": first_step - t["synced"],
            "total": first_step - detected,
        }
        self._progress.offer_event("generation formed", f"world {self.size}: {gen.reason}",
                                   gen.number, timings)

    def _finish(self) -> None:
        self._complete_pending_quietly()
        # Every rank records the end (create-if-absent: the first record stays), and none
        # returns before etcd holds it: were it left to rank 0 alone, its death or one failed
        # write would make the next peer to start train the finished job again. finish()
        # retries while etcd is unreachable and raises a clear error if that lasts.
        self.coordinator.finish(True, "training function returned")

    def _complete_pending_quietly(self) -> None:
        """The training function returned on every rank: complete the last check's op (every
        rank issued it), so the group is never torn down under it. Its answer no longer
        matters, and neither does its failure (a peer that died since): the run is done."""
        self.straggler.settle()  # the exchange of paces in flight, likewise
        if self._group is None or not self._pending.pending:
            self._pending.drop()
            return
        try:
            with self._liveness.collective():
                self._pending.complete(self._group)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            log.info("the last check's exchange failed after the run ended: %s", exc)

    def _leave(self, why: str, wait_s: float = 10.0) -> None:
        """We are out of the roster: wait (bounded) until the others formed, then go."""
        log.info("%s", why)
        self._pending.drop()
        self.straggler.drop()
        coord = self.coordinator
        snap = coord.snapshot()
        gen = snap.generation
        if gen is not None:
            coord.view.wait_for(
                lambda s: s.generation is None or s.generation.number != gen.number
                or set(s.generation.roster) <= s.ready_for(gen.number), wait_s)
        self.groups.destroy()

    def record_progress(self, **fields: int) -> None:
        """Publish the committed position for ``peer-elastic status`` (rank 0; no waiting)."""
        if self.rank == 0:
            self._progress.offer(generation=self.generation, world_size=self.size, **fields)

    def waiting_on_peers(self) -> AbstractContextManager[None]:
        """Mark a wait on other peers that the hang detector cannot see on the stack.

        Collectives under ``torch.distributed``, DDP and backward are recognised by
        themselves; wrap anything else that blocks until other peers act (an async
        ``Work.wait()`` from your own code, a device sync that waits for an nccl
        collective) so that time is never taken for a hang of this peer.
        """
        return self._liveness.collective()

    def hang_exempt(self) -> AbstractContextManager[None]:
        """Mark work of the training thread that may outlast ``hang_timeout_s`` and is not a
        hang: a checkpoint your code saves, a long evaluation pass without steps.

        Its time never counts towards a hang, and the clock starts afresh when it ends. A
        hang inside it is not detected, so mark only work that ends.
        """
        return self._liveness.exempt()

    def close(self) -> None:
        self.straggler.close()
        if self._sharded_snapshots is not None:
            self._sharded_snapshots.close(timeout=60.0)
        if self.snapshots is not None:
            # A write in flight finishes (bounded): the process may exit right after.
            self.snapshots.close(timeout=60.0)
        self._liveness.stop()
        self._progress.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._pending.drop()
        self.groups.close()


class _Publisher:
    """Writes progress (the newest, at most once a second), the state's commit count
    (peer_elastic.lost_state) and events from a thread, so the training thread never waits
    on etcd."""

    def __init__(self, coordinator: Coordinator, period_s: float = 1.0) -> None:
        self._coord = coordinator
        self._period = period_s
        self._latest: dict[str, int] | None = None
        self._state: tuple[int, int] | None = None  # (commits, generation) to say
        self._events: list[tuple[str, str, int, dict[str, float]]] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def offer(self, **fields: int) -> None:
        with self._cv:
            self._latest = fields
            self._start()

    def offer_state(self, commits: int, generation: int) -> None:
        with self._cv:
            self._state = (commits, generation)
            self._start()

    def offer_event(self, kind: str, detail: str, generation: int,
                    timings: dict[str, float]) -> None:
        with self._cv:
            self._events.append((kind, detail, generation, timings))
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threads.start(self._publish_loop, "publisher")
        self._cv.notify()

    def _publish_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._latest is not None or self._events
                                  or self._state is not None or self._stopped)
                if self._stopped:
                    return
                fields, self._latest = self._latest, None
                events, self._events = self._events, []
                committed, self._state = self._state, None
            for kind, detail, generation, timings in events:
                self._coord.record_event(kind, detail, generation=generation, timings=timings)
            if committed is not None:
                self._coord.record_state(*committed)
            if fields is not None:
                try:
                    self._coord.record_progress(**fields)
                except PeerElasticError as exc:
                    log.debug("progress not recorded: %s", exc)
                time.sleep(self._period)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
