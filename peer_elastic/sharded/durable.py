"""Durable snapshots of a ShardedState: every rank writes its own rows, any world size loads.

The run loop (:class:`~peer_elastic.elastic.Peer`) owns one :class:`ShardedSnapshots` when a
job with a ``snapshot_dir`` trains a :class:`~peer_elastic.sharded.ShardedState`:

* :meth:`ShardedSnapshots.regrouped`, on every rank when a group formed: a writer
  (:class:`~peer_elastic.durable.sharded.ShardedSnapshotWriter`) on a gloo group of its own,
  so the writes run on a thread while training runs collectives on the default group.
* :meth:`ShardedSnapshots.after_commit`, on every rank after each commit: one all-reduce
  carries rank 0's "a snapshot is due" with its clock (the snapshot's name) and every
  rank's "still writing"; all ranks then offer the same snapshot, or all skip it.
* :meth:`ShardedSnapshots.resume`, the run loop's resume hook: the newest complete sharded
  snapshot every rank agrees on, loaded with DCP into a module built on the new mesh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from peer_elastic.durable.layout import CorruptSnapshot, SnapshotId
from peer_elastic.durable.service import DurableSnapshots
from peer_elastic.durable.sharded import (
    ShardedLoadError,
    ShardedSnapshotWriter,
    check_sharded,
    load_checked,
)
from peer_elastic.durable.writer import SnapshotInfo
from peer_elastic.sharded.plan import Layout
from peer_elastic.sharded.state import ShardedState
from peer_elastic.state.agreement import Agreement, Claim, StateVersion, new_lineage
from peer_elastic.state.states import TorchState

__all__ = ["ShardedSnapshots"]

log = logging.getLogger(__name__)

_NONE = (-1, -1, -1, -1, -1)


class ShardedSnapshots:
    """One peer's sharded snapshots (see the module docstring)."""

    def __init__(self, service: DurableSnapshots) -> None:
        self.directory = service.directory
        self.every_s = service.every_s
        self.keep = service.keep
        self._listener = service.listener
        self._hang_exempt = service.hang_exempt
        self._writer: ShardedSnapshotWriter | None = None
        self._last = time.monotonic()  # rank 0: the first is due every_s after the start

    def regrouped(self) -> None:
        """Collective on the new group: a writer of its own for this generation."""
        self.close()
        group = dist.new_group(backend="gloo")
        self._writer = ShardedSnapshotWriter(self.directory, group, self.keep,
                                             listener=self._listener,
                                             hang_exempt=self._hang_exempt)

    def after_commit(self, state: ShardedState, info: SnapshotInfo,
                     device: torch.device) -> bool:
        """Collective right after a commit: write a snapshot if one is due on rank 0 and no
        rank is still writing the last one. Returns whether one was started."""
        writer = self._writer
        if writer is None:
            return False
        due = time.monotonic() - self._last >= self.every_s
        rank0 = dist.get_rank() == 0
        flags = torch.tensor([int(due and rank0), int(writer.busy()),
                              time.time_ns() if rank0 else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        due_now, busy, unix_ns = (int(v) for v in flags.tolist())
        if not due_now:
            return False
        if busy:
            writer.note_skipped()
            return False
        if rank0:
            self._last = time.monotonic()
        tensors, replicated, plain = state.durable_parts()
        sid = SnapshotId.of(info.version or StateVersion(commits=state.commit_count), unix_ns)
        epoch = getattr(state, "epoch", 0)
        return writer.offer(tensors, replicated, plain, sid, run_id=info.run_id,
                            generation=info.generation,
                            epoch=epoch if isinstance(epoch, int) else 0)

    def newest_version(self) -> StateVersion | None:
        newest = self.directory.newest_complete(sharded=True)
        return newest.id.version if newest is not None else None

    def resume(self, state: ShardedState, claims: Sequence[Claim], generation: int,
               device: torch.device) -> Agreement | None:
        """Collective: load the newest sharded snapshot every rank can read that is newer
        than what the group holds, into a module on this group's mesh. None when none loads
        (the caller goes on from what it holds, or fails, or starts fresh)."""
        held = max(c.version for c in claims)
        above = held if held.trained else None
        layout = state.new_layout(generation)
        skip: set[SnapshotId] = set()
        while True:
            found = self.directory.newest_complete(frozenset(skip), above=above, sharded=True)
            mine = (found.id.lineage, found.id.commits, found.id.generation, found.id.step,
                    found.id.unix_ns) if found is not None else _NONE
            buf = torch.tensor(mine, dtype=torch.int64, device=device)
            gathered = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, buf)
            best = max(tuple(int(v) for v in t.tolist()) for t in gathered)
            if best == _NONE:
                return None
            sid = SnapshotId(*best)
            if self._load(state, sid, layout, device):
                log.warning("resuming job %s from sharded snapshot %s (commit %d) at %d x %d "
                            "shards", self.directory.job, self.directory.snapshot_path(sid),
                            sid.commits, layout.replicas, layout.shards)
                return Agreement(0, StateVersion(new_lineage(claims), sid.commits, generation, 0))
            skip.add(sid)

    def _load(self, state: ShardedState, sid: SnapshotId, layout: Layout,
              device: torch.device) -> bool:
        """Collective: build a module on ``layout``'s mesh and load ``sid`` into it; False
        (on every rank) when it does not load. The other values (sampler, plain values) go
        back to what they were when it fails: a partial load never stays."""
        TorchState.save(state)
        try:
            with self.directory.reading(sid):
                plain = check_sharded(self.directory, sid, device=device)
                targets, replicated, install = state.load_targets(layout, device, plain)
                load_checked(self.directory, sid, {**targets, **replicated})
            install()
            return True
        except CorruptSnapshot as exc:
            log.warning("sharded snapshot %s cannot be loaded, trying an older one: %s",
                        sid.name, exc)
            if dist.get_rank() == 0:
                self.directory.set_aside(sid, str(exc))
        except (ShardedLoadError, ValueError, KeyError) as exc:
            # ValueError/KeyError: its catalog does not describe this model (every rank
            # reads the same catalog, so every rank fails alike)
            log.warning("sharded snapshot %s does not fit this state, trying an older one: "
                        "%s", sid.name, exc)
        TorchState.restore(state)
        return False

    def close(self, timeout: float = 0.0) -> None:
        """Stop this generation's writer (a write in flight may finish within ``timeout``)."""
        if self._writer is not None:
            self._writer.close(timeout)
            self._writer = None
