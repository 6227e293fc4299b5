"""Resuming from the newest durable snapshot.

A group resumes when no rank holds trained state (the job was started afresh, or every
peer holding the state was lost), or when some rank sees a snapshot newer than every
version the group holds (the holders are behind it: a peer parked by ``set max_np`` while
the others trained on and were then lost). :func:`resume` runs on every rank, in the same
call of the same state agreement, so every rank takes the same path:

1. Each rank finds the newest snapshot in its own view of the snapshot directory that looks
   complete (manifest present, files of the listed sizes; cheap) and is newer than what the
   group holds. Views can differ: with a local ``snapshot_dir`` only the hosts rank 0 ran
   on have snapshots.
2. One all-gather; the newest id wins; the lowest rank that has it verifies every checksum
   and loads it into its live state (DCP, no process group), on a thread of its own.
3. Meanwhile every rank takes part in a short all-reduce once a second that says whether
   the load has ended and how: a large snapshot takes as long as it takes, and no single
   collective waits for it (so ``collective_timeout_s`` bounds each round, not the load).
   A loader that dies breaks the round, and the group re-forms as after any death.
4. If the load failed (a corrupt file, a model that does not match), every rank skips that
   snapshot and goes back to 1 without it; the loader's live state goes back to what it held
   (saved as its restore point before the load), so a partial load never survives. A snapshot whose files do not match
   their manifest is set aside (renamed), never to be chosen or kept again.
5. The loader is the sync source of the ordinary state sync, which hands the state to the
   others (any world size: the state is replicated, the sampler re-partitions). The resumed
   state starts a new lineage (:mod:`peer_elastic.state.agreement`).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from peer_elastic.durable.layout import PLAIN, CorruptSnapshot, Manifest, SnapshotDir, SnapshotId
from peer_elastic.process import threads
from peer_elastic.state.agreement import Agreement, Claim, StateVersion, new_lineage
from peer_elastic.state.codec import decode_values

__all__ = ["ROUND_S", "load_snapshot", "resume"]

log = logging.getLogger(__name__)

# DCP warns on every no_dist call that it assumes a single process: that is the design here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

#: How long the loader lets one progress round wait for its load to end.
ROUND_S = 1.0
_REPORT_EVERY_S = 30.0
_NONE = (-1, -1, -1, -1, -1)


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


@dataclass
class _Load:
    """One load on the loader's own thread; the training thread waits in rounds."""

    ended: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    manifest: Manifest | None = None


def _start_load(state: Any, directory: SnapshotDir, sid: SnapshotId) -> _Load:
    load = _Load()

    def run() -> None:
        try:
            load.manifest = load_snapshot(state, directory, sid)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank, then retried
            load.error = exc
        finally:
            load.ended.set()

    threads.start(run, "snapshot-load")
    return load


def _wait_in_rounds(load: _Load | None, device: torch.device, sid: SnapshotId,
                    renew: Callable[[], None]) -> bool:
    """Collective: rounds of one small all-reduce until the loader's load has ended;
    whether it failed (the same answer on every rank)."""
    t0 = last_report = time.monotonic()
    while True:
        ended = failed = 0
        if load is not None:
            if load.ended.wait(ROUND_S):
                ended, failed = 1, int(load.error is not None)
            renew()
            now = time.monotonic()
            if not ended and now - last_report >= _REPORT_EVERY_S:
                last_report = now
                log.warning("still loading snapshot %s: %.0f s so far", sid.name, now - t0)
        flags = torch.tensor([ended, failed], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return bool(flags[1].item())


def resume(state: Any, directory: SnapshotDir, generation: int, device: torch.device,
           claims: Sequence[Claim]) -> Agreement | None:
    """Collective: load the newest snapshot any rank can read that is newer than what the
    group holds (see the module docstring).

    Returns the agreement to sync by (the loader as source), or None when no rank has such
    a snapshot that loads: then the group keeps what it holds (or the initial state).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    held = max(c.version for c in claims)
    above = held if held.trained else None
    skip: set[SnapshotId] = set()
    while True:
        found = directory.newest_complete(frozenset(skip), above=above, sharded=False)
        mine = _as_ints(found.id) if found is not None else _NONE
        buf = torch.tensor(mine, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(gathered, buf)
        offers = [tuple(int(v) for v in t.tolist()) for t in gathered]
        best = max(offers)
        if best == _NONE:
            if above is not None:
                log.error("no snapshot newer than the state held in memory (%s) could be "
                          "loaded: going on from the held state", held.as_ints())
            return None
        sid = SnapshotId(*best)
        loader = offers.index(best)
        with directory.reading(sid) as renew:
            load = None
            if rank == loader:
                # The live state becomes the restore point first: a failed load goes back to
                # exactly what this rank held (it may hold trained state the group keeps).
                state.save()
                load = _start_load(state, directory, sid)
            failed = _wait_in_rounds(load, device, sid, renew)
        if load is not None:
            if load.error is None and load.manifest is not None:
                log.warning("resuming job %s from snapshot %s (commit %d, epoch %d)",
                            directory.job, directory.snapshot_path(sid), sid.commits,
                            load.manifest.epoch)
            else:
                log.warning("snapshot %s cannot be loaded, trying an older one: %s",
                            directory.snapshot_path(sid), load.error)
                state.restore()  # a partial load must not stay in the live state
                if isinstance(load.error, CorruptSnapshot):
                    directory.set_aside(sid, str(load.error))
        if not failed:
            # Step 0 of this generation: no check of this group ever produces that version.
            version = StateVersion(new_lineage(claims), sid.commits, generation, 0)
            return Agreement(loader, version)
        skip.add(sid)


def _as_ints(sid: SnapshotId) -> tuple[int, int, int, int, int]:
    return (sid.lineage, sid.commits, sid.generation, sid.step, sid.unix_ns)
