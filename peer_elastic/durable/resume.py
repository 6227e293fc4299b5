"""Resuming a whole job from its newest durable snapshot.

When a group forms in which no rank holds committed state of the run (every claim is at the
initial :class:`~peer_elastic.agreement.StateVersion`: the job was started afresh, e.g.
after every peer was lost), :func:`resume` runs on every rank, in the same call of the same
state agreement, so every rank takes the same path:

1. Each rank finds the newest snapshot in its own view of the snapshot directory that looks
   complete (manifest present, files of the listed sizes; cheap). Views can differ: with
   a local ``snapshot_dir`` only the hosts rank 0 ran on have snapshots.
2. One all-gather; the newest id wins; the lowest rank that has it verifies every checksum
   and loads it into its live state (DCP, no process group).
3. One all-reduce says whether that worked. If not (a corrupt file), every rank skips that
   snapshot and goes back to 1 without it; the loader's live state goes back to its last
   commit first, so a partial load never survives.
4. The loader is the sync source of the ordinary state sync, which hands the state to the
   others (any world size: the state is replicated, the sampler re-partitions).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

from peer_elastic.agreement import Agreement, StateVersion
from peer_elastic.codec import decode_values
from peer_elastic.durable.layout import PLAIN, CorruptSnapshot, Manifest, SnapshotDir, SnapshotId

__all__ = ["load_snapshot", "resume"]

log = logging.getLogger(__name__)

# DCP warns on every no_dist call that it assumes a single process: that is the design here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

_NONE = (-1, -1)


def load_snapshot(state: Any, directory: SnapshotDir, sid: SnapshotId) -> Manifest:
    """Verify ``sid`` and load it into ``state``'s live objects (this rank only)."""
    import torch.distributed.checkpoint as dcp

    manifest = directory.verify(sid)
    path = directory.snapshot_path(sid)
    try:
        plain = decode_values((path / PLAIN).read_bytes())
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"{sid.name}/{PLAIN}: {exc}") from None
    targets = state.durable_targets(plain)
    if targets:
        with torch.no_grad():
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return manifest


def resume(state: Any, directory: SnapshotDir, generation: int,
           device: torch.device) -> Agreement | None:
    """Collective: load the newest snapshot any rank can read (see the module docstring).

    Returns the agreement to sync by (the loader as source), or None when no rank has a
    usable snapshot: then the run starts from the initial state.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    skip: set[SnapshotId] = set()
    while True:
        found = directory.newest_complete(frozenset(skip))
        mine = (found.id.commits, found.id.unix_ns) if found is not None else _NONE
        buf = torch.tensor(mine, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(gathered, buf)
        offers = [tuple(int(v) for v in t.tolist()) for t in gathered]
        best = max(offers)
        if best == _NONE:
            return None
        sid = SnapshotId(*best)
        loader = offers.index(best)
        failed = 0
        if rank == loader:
            try:
                manifest = load_snapshot(state, directory, sid)
                log.warning("resuming job %s from snapshot %s (commit %d, epoch %d)",
                            directory.job, directory.snapshot_path(sid), sid.commits,
                            manifest.epoch)
            except Exception as exc:  # noqa: BLE001 - any failure: try the next older one
                log.warning("snapshot %s cannot be loaded, trying an older one: %s",
                            directory.snapshot_path(sid), exc)
                state.restore()  # a partial load must not stay in the live state
                failed = 1
        flag = torch.tensor([failed], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            # Step 0 of this generation: no check of this group ever produces that version.
            return Agreement(loader, StateVersion(sid.commits, generation, 0))
        skip.add(sid)
