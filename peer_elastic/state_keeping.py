"""The training state as the run loop keeps it between groups: its versions, the agreement a
new group reaches on it, commits, restores and durable snapshots.

:class:`~peer_elastic.elastic.Peer` owns one :class:`StateKeeping`. It knows the version of
the live state and of the last commit (:mod:`peer_elastic.state.agreement`) and keeps them
true through every step of the run loop:

* a new group settles its state (:meth:`StateKeeping.settle`): a replicated state agrees on
  the newest version and syncs from a holder (:func:`~peer_elastic.state.sync.agree_and_sync`,
  resuming from a durable snapshot when nobody holds trained state); a sharded state
  regroups and reshards in memory (:func:`~peer_elastic.sharded.regroup.regroup`). A group
  that goes on from less than the run's state had says so (:mod:`peer_elastic.state.lost_state`);
* a commit is recorded (:meth:`StateKeeping.commit`): rank 0 marks that the state has
  commits, and a due durable snapshot is written (rank 0's whole state, or every rank's
  rows of a sharded one);
* a failed collective restores the last commit (:meth:`StateKeeping.restore`), and a sharded
  state is handed off before a reset (:meth:`StateKeeping.hand_off`);
* a graceful leave writes a final snapshot (:meth:`StateKeeping.final_snapshot`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from peer_elastic.durable.service import DurableSnapshots
from peer_elastic.durable.writer import SnapshotInfo
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.liveness import TrainingWatch
from peer_elastic.observer import PeerStats, StepObserver
from peer_elastic.publisher import Publisher
from peer_elastic.records import JobConfig, RunRecord
from peer_elastic.sharded.durable import ShardedSnapshots
from peer_elastic.sharded.regroup import regroup
from peer_elastic.sharded.state import ShardedState
from peer_elastic.state.agreement import Agreement, Claim, StateVersion
from peer_elastic.state.lost_state import StateMarker, lost_state
from peer_elastic.state.protocol import ElasticState
from peer_elastic.state.sync import agree_and_sync
from peer_elastic.torch.formed_group import FormedGroup

__all__ = ["KeepingCoordinator", "StateKeeping"]

log = logging.getLogger(__name__)


class KeepingCoordinator(Protocol):
    """What :class:`StateKeeping` uses of the coordinator: the job's snapshot settings and
    where its records go, and the run's state as the watched view holds it."""

    member_id: str
    job: str
    config: JobConfig
    client: EtcdClient
    run: RunRecord | None  # None before this peer registers

    def snapshot(self) -> ViewSnapshot: ...


class StateKeeping:
    """The versions of one peer's training state and what keeps them; see the module
    docstring."""

    def __init__(self, coordinator: KeepingCoordinator, stats: PeerStats,
                 publisher: Publisher, liveness: TrainingWatch,
                 observer: StepObserver) -> None:
        self._coord = coordinator
        self._stats = stats
        self._publisher = publisher
        self._liveness = liveness
        self._observer = observer
        # The version of the live state and of the last commit (peer_elastic.state.agreement).
        self.live = StateVersion()
        self.committed = StateVersion()
        self.restored = False  # since the last reset (for metrics)
        self._synced_once = False
        # Rank 0 says in etcd that the state has commits (peer_elastic.state.lost_state).
        self._marker = StateMarker(publisher.offer_state)
        # Durable snapshots (peer_elastic.durable), when the job has a snapshot_dir: rank 0
        # writes one in the background at a due commit; a group in which nobody holds
        # committed state resumes from the newest.
        self.snapshots = DurableSnapshots.for_job(coordinator.config, coordinator.job, stats,
                                                  coordinator.client,
                                                  hang_exempt=liveness.exempt)
        # A ShardedState's snapshots: every rank writes its rows (made at its first group).
        self._sharded_snapshots: ShardedSnapshots | None = None

    def stepped(self, generation: int) -> None:
        """A step of the training function ran in ``generation``."""
        self.live = self.live.stepped(generation)

    def commit(self, state: ElasticState, group: FormedGroup, device: torch.device) -> None:
        """Save the commit the ranks agreed on in this check, then what follows a commit:
        rank 0's mark, a due durable snapshot."""
        if isinstance(state, ShardedState):
            state.expect_save(self.live.committed())  # its shards carry their version
        state.record_commit()
        self.live = self.committed = self.live.committed()
        if group.assignment.rank == 0:
            self._marker.committed(self.committed.commits, group.generation)
            if self.snapshots is not None and not isinstance(state, ShardedState):
                self.snapshots.after_commit(state, self._snapshot_info(group, self.committed))
        if isinstance(state, ShardedState) and self._sharded_snapshots is not None:
            # every rank writes its rows: all decide together, right after the commit
            with self._liveness.collective():
                self._sharded_snapshots.after_commit(
                    state, self._snapshot_info(group, self.committed), device)

    def restore(self, state: ElasticState) -> None:
        """Back to the last commit, and to its version."""
        state.restore()
        self.live = self.committed
        self.restored = True

    def settle(self, state: ElasticState, group: FormedGroup, device: torch.device) -> None:
        """Collective, each time a group forms: agree on the state the group keeps, and sync
        (or reshard) it where needed."""
        # Joiners and returning members (the generation's `joined`) always take state, even
        # when their version matches: it costs one sync and relies on nothing they kept.
        need = not self._synced_once or group.assignment.joined
        t0 = time.perf_counter()
        if isinstance(state, ShardedState):
            agreement, looked = self._regroup(state, group, need, device)
            self._agreed(agreement, group, t0, looked)
            return
        resume_from_snapshot = None
        newest_snapshot = None
        if self.snapshots is not None:
            resume_from_snapshot = self.snapshots.resumer(state, group.generation, device)
            newest_snapshot = self.snapshots.newest_version()
        resumed = False

        def resume(claims: Sequence[Claim]) -> Agreement | None:
            # agree_and_sync calls this on every rank exactly when no rank holds trained
            # state (the first group of a run, or every holder lost), or when a snapshot is
            # newer than every version held (peer_elastic.state.lost_state says what was lost).
            nonlocal resumed
            resumed = True
            return resume_from_snapshot(claims) if resume_from_snapshot is not None else None

        claim = Claim(self.live, need, newest_snapshot, time.time_ns())
        agreement = agree_and_sync(state, claim, device, resume, committed=self.committed)
        self._agreed(agreement, group, t0, resumed)

    def _agreed(self, agreement: Agreement, group: FormedGroup, t0: float,
                resumed: bool) -> None:
        """What every new group does once its state is agreed (``resumed``: it looked for a
        durable snapshot)."""
        if agreement.source is not None:
            self._observer.on_sync(time.perf_counter() - t0)
        self._report_lost_state(agreement.version, group, held=not resumed)
        self.live = agreement.version
        if agreement.source is not None:
            # The sync saved what every rank now holds as the restore point. A skipped sync
            # saved nothing: the restore point is still the last commit, and its version must
            # stay that commit's, or a restore would name the live state it no longer holds.
            self.committed = agreement.version
        self._synced_once = True
        self.restored = False

    def _regroup(self, state: ShardedState, group: FormedGroup, need: bool,
                 device: torch.device) -> tuple[Agreement, bool]:
        """The sharded state's agreement: reshard in memory, load a snapshot, or start."""
        durable = self._sharded_snapshots
        if durable is None and self.snapshots is not None:
            durable = self._sharded_snapshots = ShardedSnapshots(self.snapshots)
        newest = durable.newest_version() if durable is not None else None
        claim = Claim(self.live, need, newest, time.time_ns())
        generation = group.generation

        def resume(claims: Sequence[Claim]) -> Agreement | None:
            assert durable is not None
            return durable.resume(state, claims, generation, device)

        result = regroup(state, claim, device, generation,
                         resume if durable is not None else None)
        if durable is not None:
            durable.regrouped()  # a writer on a gloo group of this generation's own
        return result

    def _report_lost_state(self, agreed: StateVersion, group: FormedGroup, held: bool) -> None:
        """A group formed that goes on from a resumed snapshot, from the initial state, or
        (``held``) from an in-memory version older than the run's state had: if the run's
        state had more commits, say loudly that they were lost and where training goes on
        from. Never a silent rollback."""
        lost = lost_state(self._coord.snapshot().state, agreed, held=held)
        if lost is None:
            return  # the first group of a run, or nothing lost
        what = lost.describe()
        log.error("%s", what)
        self._stats.count("states_lost")
        if group.assignment.rank == 0:
            self._publisher.offer_event("state_lost", what, group.generation, {})

    def hand_off(self, state: ShardedState, generation: int) -> None:
        """The group of ``generation`` is about to be replaced and still works: save the live
        sharded state with every leaving rank's shard copied to ranks that stay (a leaver's
        shard must outlive it; a joiner gets its rows from the holders when the next group
        forms)."""
        snap = self._coord.snapshot()
        newest = snap.generation
        leaving = newest is not None and newest.number > generation \
            and self._coord.member_id not in snap.roster_ids()
        with self._liveness.collective():
            state.hand_off(self.live, leaving)
        self.committed = self.live

    def final_snapshot(self, state: ElasticState, group: FormedGroup | None) -> None:
        """Leaving on purpose (SIGTERM, drain) as rank 0 of the last group: write a durable
        snapshot of the live state (a consistent version: the interrupt merged progress
        first), so stopping the whole job gracefully loses nothing. Rank 0 alone leaving
        writes one too: it cannot know whether anyone goes on, and it costs one write."""
        if self.snapshots is None or group is None or group.assignment.rank != 0:
            return
        if isinstance(state, ShardedState):
            return  # every rank writes its shard; a leaver's shard went to the ranks that stay
        if self.snapshots.final(state, self._snapshot_info(group, self.live)):
            log.warning("final snapshot written before leaving")
        else:
            log.warning("final snapshot not written (see above)")

    def _snapshot_info(self, group: FormedGroup, version: StateVersion) -> SnapshotInfo:
        run = self._coord.run
        return SnapshotInfo(run.run_id if run is not None else "", group.generation,
                            group.assignment.size, version)

    def close(self) -> None:
        """A write in flight finishes (bounded): the process may exit right after."""
        if self._sharded_snapshots is not None:
            self._sharded_snapshots.close(timeout=60.0)
        if self.snapshots is not None:
            self.snapshots.close(timeout=60.0)
