"""The elastic run loop: Horovod Elastic semantics on top of the coordination core.

:class:`Peer` owns the per-step protocol (in the manner of torchft's ``Manager``); the
process group it reconfigures lives in :mod:`peer_elastic.torch.group`, the membership in
:mod:`peer_elastic.etcd.coordinator`.

One pass of :meth:`Peer.run`::

    form the group of the newest generation listing us  (standbys wait here)
    -> reset callbacks on every rank (they see the new world size and may use collectives)
    -> agree on state: one all-gather of every rank's (needs state?, state version); sync
       from the lowest rank holding the newest version unless all hold the same one
       (peer_elastic.state.agreement)
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
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from peer_elastic import logs
from peer_elastic.errors import (
    HostsUpdatedInterrupt,
    LeaveRequested,
    PeerElasticError,
    ShardedStateLost,
)
from peer_elastic.liveness import TrainingWatch
from peer_elastic.observer import (
    NoObserver,
    ObservedCoordinator,
    PeerStats,
    StepObserver,
    observed,
)
from peer_elastic.publisher import ProgressRecorder, Publisher
from peer_elastic.records import GenerationRecord
from peer_elastic.sharded.state import ShardedState, forget_meshes
from peer_elastic.state.protocol import ElasticState
from peer_elastic.state_keeping import KeepingCoordinator, StateKeeping
from peer_elastic.straggler.watch import StragglerCoordinator, StragglerWatch
from peer_elastic.torch.check.generation_check import GenerationCheck
from peer_elastic.torch.check.reset_vote import voting
from peer_elastic.torch.formed_group import FormedGroup
from peer_elastic.torch.gloo.abort import HangWatchdog
from peer_elastic.torch.group import GroupCoordinator, GroupManager, is_collective_failure

log = logging.getLogger(__name__)

R = TypeVar("R")


class PeerCoordinator(GroupCoordinator, KeepingCoordinator, ProgressRecorder,
                      ObservedCoordinator, StragglerCoordinator, Protocol):
    """What a :class:`Peer` uses of the coordinator: what its group manager, its state
    keeping, its publisher and its straggler watch use, what its observer reads (metrics),
    and the rest of this peer's membership. The training thread's liveness fences the peer
    through it when the thread hangs (:func:`peer_elastic.etcd.fence.fence_member`, which
    also reads ``lease_id`` and ``close``)."""

    local_rank: int
    lease_id: int

    @property
    def is_leader(self) -> bool: ...

    @property
    def latest_generation(self) -> GenerationRecord | None: ...

    def finish(self, success: bool = True, reason: str = "",
               timeout_s: float = ...) -> bool: ...

    def close(self, leave: bool = True) -> None: ...


class Peer:
    """A training process's membership in an elastic job. Create it with :func:`peer_elastic.join`."""

    def __init__(
        self,
        coordinator: PeerCoordinator,
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
                                       on_waiting=self.groups.reach.waited_on_peers)
        self._group: FormedGroup | None = None
        self._incarnation = coordinator.incarnation
        # The per-step check's collectives: the generation exchange, its cadence, the vote
        # carried by gradient all-reduces (peer_elastic.torch.check).
        self._checks = GenerationCheck(coordinator, self.stats, self._liveness.collective,
                                       lambda: self.device, lambda: self._group)
        self._state: ElasticState | None = None  # the state given to run()
        self.resets = 0
        self.last_reset_s = 0.0
        self.reset_log: list[dict[str, Any]] = []
        self._pending_timing: dict[str, Any] | None = None
        self._progress = Publisher(coordinator)
        # peer_elastic.metrics.PeerMetrics, or None when off (a NoopMetrics is falsy): then
        # nothing wraps the per-step check, and the other hooks go to a NoObserver.
        self.metrics = metrics if metrics else None
        self._observer: StepObserver = self.metrics or NoObserver()
        self._observer.bind(self)
        # The state's versions, its agreement when a group forms, commits, restores and
        # durable snapshots (peer_elastic.state_keeping).
        self._keeping = StateKeeping(coordinator, self.stats, self._progress, self._liveness,
                                     self._observer)
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

    def _check(self, state: ElasticState | None, committing: bool) -> None:
        """The per-step protocol behind ``state.commit()`` and ``state.check_host_updates()``.

        No etcd I/O: the newest generation comes from the watched view in memory. The
        check's collectives (:class:`~peer_elastic.torch.check.generation_check.GenerationCheck`)
        make every rank decide the same at the same call, mostly without waiting on anyone:
        a plain check completes the exchange the previous one issued, or takes the vote an
        optimizer step's gradient all-reduce carried.

        A commit, and a check that finds a reset due, first learn in one blocking exchange
        whether some rank holds unmerged progress. Then, in this order: merge the progress
        some rank recorded only locally (only when some rank has such progress), save the
        commit, raise if a new generation is pending. A rank whose collective fails never
        gets to save or keep the step: it restores its last commit, whose progress was
        merged (see ``peer_elastic.state.agreement``).

        At the top, about once a second at the same checks on every rank, the straggler
        watch completes and issues its exchange of paces (:mod:`peer_elastic.straggler`):
        the one collective a check after an optimizer step otherwise never runs.
        """
        group = self._group
        if group is None:
            if committing and state is not None:
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
        self._keeping.stepped(group.assignment.generation)
        verdict = self._checks.run(
            group, committing, lambda: state is not None and state.has_local_progress())
        if verdict is None:
            return  # a plain check, no reset due
        if verdict.merge and state is not None:
            with self._liveness.collective():
                state.merge_progress()
        if committing and state is not None:
            self._keeping.commit(state, group, self.device)
        if verdict.reset:
            newest = verdict.snapshot.generation
            removals_only = newest is not None and not newest.joined
            raise HostsUpdatedInterrupt(skip_sync=removals_only)

    def run(self, func: Callable[..., R], state: ElasticState, *args: Any, **kwargs: Any) -> R:
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
                    # the reset vote (peer_elastic.torch.check.reset_vote)
                    with self._liveness.training(), voting(self._checks.vote):
                        result = func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    log.info("hosts updated%s: resetting", " (removals only)" if exc.skip_sync else "")
                    after = self.generation
                    if isinstance(state, ShardedState):
                        try:
                            self._keeping.hand_off(state, self.generation)
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
            self._keeping.final_snapshot(state, self._group)
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

    def _on_collective_failure(self, state: ElasticState, exc: Exception) -> None:
        """A peer died mid-collective: roll back to the last commit and tell the leader."""
        log.warning("collective failed in generation %d: %s; restoring the last commit",
                    self.generation, exc)
        self._checks.drop()  # its group is broken: never wait on its op
        self._keeping.restore(state)
        self.coordinator.mark_broken(self.generation, str(exc)[:300])  # best effort, logged

    def _reset(self, state: ElasticState, after: int) -> None:
        t0 = time.monotonic()
        first = self._group is None and after == 0
        # how we got here, for metrics
        restored, incarnation = self._keeping.restored, self._incarnation
        self._checks.new_group()
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
                    self._keeping.settle(state, self._group, self.device)
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
                self._keeping.restore(state)
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
        try:
            self._checks.complete_quietly(self._group)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            log.info("the last check's exchange failed after the run ended: %s", exc)

    def _leave(self, why: str, wait_s: float = 10.0) -> None:
        """We are out of the roster: wait (bounded) until the others formed, then go."""
        log.info("%s", why)
        self._checks.drop()
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
        self._keeping.close()  # a snapshot write in flight finishes (bounded)
        self._liveness.stop()
        self._progress.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._checks.drop()
        # DTensor's caches pin the last mesh and its group: cleared, the group goes with the
        # last module on it (its destructor joins its gloo threads) instead of living on
        # through the interpreter's exit.
        forget_meshes()
        self.groups.close()
