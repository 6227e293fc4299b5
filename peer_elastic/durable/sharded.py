"""Durable snapshots of sharded (FSDP2 / HSDP) state: every rank writes its own shards.

The replicated writer (:mod:`.writer`) has rank 0 write the whole state, which every rank
holds. Under FSDP2 no rank holds the whole state, and gathering it on one rank would cost
the memory sharding saves, so here every rank writes the rows it holds, in parallel, with
``torch.distributed.checkpoint`` (DCP): one ``__<rank>_0.distcp`` per rank, and DCP's
``.metadata`` (written by rank 0 of the group) maps every tensor's global rows to those
files. Loading (:func:`load_sharded`) at any world size or mesh is DCP's resharding load:
each rank reads exactly the rows of its new shards.

**Writing** (:class:`ShardedSnapshotWriter`, one per rank). What the training thread pays:
copying its local shards (and, on rank 0, the replicated tensors) into staging buffers,
allocated once and refilled with ``copy_``, and encoding the plain values. Everything
else runs on a writer thread, with collectives on a *dedicated* gloo group only, never on
the default group: the training thread keeps issuing its own collectives on the default
group meanwhile, and two threads issuing collectives on one group interleave them and
deadlock or corrupt both. Each snapshot is one round of collectives on that group, the same
on every rank whatever fails, so a failure never leaves the group out of step:

1. an all-reduce of "my staging copy worked" (a rank whose copy failed still takes part,
   so the others learn to skip rather than wait for it);
2. ``dcp.save`` into a temporary directory all ranks name alike (DCP gathers every rank's
   errors and raises them on every rank, so its own collectives stay matched too);
3. rank 0 writes the plain part (tagged JSON, :mod:`peer_elastic.state.codec`) next to DCP's
   files;
4. an all-reduce of "everything I wrote is on disk": only when every rank says so does
   rank 0 rename the directory into place, give it its manifest, and prune. Until then
   the previous snapshot is untouched, so a crash at any point leaves the newest
   complete snapshot as it was (and the temporary directory for retention to remove).

Every rank must call :meth:`ShardedSnapshotWriter.offer` at the same point with the same
``sid``; a rank whose previous round is still running cannot join a new one, so the ranks
agree first (:func:`all_ranks_idle`, a collective on the training thread's group) and all
skip the snapshot if any is still busy.

**Trust.** DCP's ``.metadata`` is a pickle, read by :func:`load_sharded` on every rank (the
tensor files are read with ``torch.load(weights_only=True)``; the plain part is JSON). As
``docs/security.md`` says for every snapshot directory: the directory must be the peers'
own ``snapshot_dir`` (never one named by etcd or any other remote party), writable only
by the job's user, and protected like code; the manifest's checksums catch corruption, not
tampering. Since every rank writes into it, it must be one directory all ranks' hosts
mount (a shared file system): the ranks must see each other's files for rank 0 to publish
them and for any rank to load them.

**Devices.** The staging buffers are CPU tensors, wrapped back as DTensors with
``DTensor.from_local(..., run_check=False, shape=, stride=)`` so that DCP knows each
shard's global offsets. ``from_local`` moves a tensor to its mesh's device type, so on a
CUDA mesh the wrapped copy lives on the device again: correct, but one more device copy of
the shards per snapshot (this module is built and tested for CPU/gloo meshes).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from peer_elastic.durable.layout import (
    PLAIN,
    CorruptSnapshot,
    Manifest,
    SnapshotDir,
    SnapshotId,
    file_entry,
    write_atomic,
)
from peer_elastic.durable.writer import SnapshotListener, Staging, Written
from peer_elastic.process import threads
from peer_elastic.state.codec import decode_values, encode_values

__all__ = [
    "ShardedLoadError", "ShardedSnapshotWriter", "all_ranks_idle", "check_sharded", "load_checked",
    "load_sharded",
]

log = logging.getLogger(__name__)


class ShardedLoadError(RuntimeError):
    """A snapshot whose files are whole but that does not load into the targets given (a
    replicated snapshot, a tensor missing from it, another shape: a model that does not
    match). Raised on every rank alike; the caller falls back to an older snapshot or a
    fresh start, and leaves this one in place (it is not corrupt)."""


@dataclass(frozen=True)
class _Layout:
    """How one staged local shard is wrapped back into a DTensor for DCP."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass
class _Round:
    """One snapshot round, handed from the training thread to the writer thread."""

    sid: SnapshotId
    manifest: Manifest
    tensors: dict[str, torch.Tensor] | None  # None: this rank's staging copy failed
    payload: bytes  # the encoded plain part (written by rank 0)
    staging_error: Exception | None = None  # why this rank's copy failed


def all_ranks_idle(writer: ShardedSnapshotWriter, group: dist.ProcessGroup | None = None,
                   device: torch.device | None = None) -> bool:
    """Collective on ``group`` (default: the default group), called by every rank at the
    same point on the training thread: True when no rank's writer is still writing, so
    every rank may call :meth:`ShardedSnapshotWriter.offer` now; False on every rank
    otherwise (this snapshot is skipped everywhere, and counted as skipped by each writer's
    listener). ``device``: where the flag's tensor lives (the group's device, e.g. CUDA
    under NCCL; CPU by default)."""
    busy = torch.tensor([int(writer.busy())], dtype=torch.int64, device=device)
    dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
    idle = not int(busy.item())
    if not idle:
        writer.note_skipped()
    return idle


class ShardedSnapshotWriter:
    """Writes this rank's part of sharded snapshots, on a thread of its own (see the
    module docstring). One per rank and per process group generation: ``group`` is a gloo
    group over the same ranks as the training group, created for this writer by every rank
    at the same time (``dist.new_group(backend="gloo")``) and used by nothing else. Its
    ``timeout`` bounds how long ranks that finished writing wait for the slowest one (DCP
    gathers the ranks' results on it), so it must exceed the longest write of one rank's
    shards. Close the writer (:meth:`close`) on every rank before that group is destroyed.
    ``keep``: how many complete snapshots retention keeps (rank 0 prunes after publishing).
    ``listener``: told of each snapshot published (rank 0), each failure (the rank that
    saw it) and each skip (:func:`all_ranks_idle`)."""

    def __init__(self, directory: SnapshotDir, group: dist.ProcessGroup, keep: int,
                 listener: SnapshotListener | None = None,
                 hang_exempt: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.directory = directory
        self.group = group
        self.keep = keep
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._listener = listener
        # Marks the staging copy as no hang of the training thread (peer_elastic.liveness).
        self._hang_exempt = hang_exempt or contextlib.nullcontext
        self._shards = Staging()  # this rank's local rows of every sharded tensor
        self._replicated = Staging()  # rank 0 only: the replicated tensors
        self._cv = threading.Condition()
        self._round: _Round | None = None
        self._busy = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.written = 0  # snapshots this writer published (rank 0) or took part in (others)

    def busy(self) -> bool:
        """Whether this rank's previous round is still running (rank 0 stays busy a little
        longer than the others: it publishes and prunes after the last collective)."""
        with self._cv:
            return self._busy

    def note_skipped(self) -> None:
        """A due snapshot was skipped because some rank was still writing (told the listener)."""
        if self._listener is not None:
            self._listener.skipped()

    def offer(self, tensors: Mapping[str, torch.Tensor], replicated: Mapping[str, torch.Tensor],
              plain: Mapping[str, Any], sid: SnapshotId, *, run_id: str, generation: int,
              epoch: int = 0) -> bool:
        """Stage a snapshot on the calling (training) thread and start writing it.

        Every rank calls this at the same point with the same ``sid`` (and the same names
        in ``tensors``), after agreeing that no rank is busy (:func:`all_ranks_idle`).
        ``tensors``: DTensors on the current mesh by stable name (FSDP2 ``Shard(0)`` or HSDP
        ``(Replicate(), Shard(0))``; live aliases are fine: they are copied here).
        ``replicated``: plain tensors equal on every rank (buffers, Adam's ``step``) and
        ``plain``: tagged-JSON-able values; both are written by rank 0 only, and only
        rank 0's are read. Returns whether this rank's copy worked; either way the round
        runs (a rank whose copy failed tells the others, and the snapshot is skipped on
        every rank). Raises RuntimeError if this rank is still busy (the caller did not
        agree first) or the writer is closed: joining anyway would put the group out of step.
        """
        with self._cv:
            if self._stopped:
                raise RuntimeError("offer on a closed ShardedSnapshotWriter")
            if self._busy:
                raise RuntimeError("offer while this rank's previous snapshot is still being "
                                   "written: agree with all_ranks_idle() before offering")
        manifest = Manifest(sid, self.directory.job, run_id, generation, self.world_size,
                            epoch, sid.commits, sharded=True)
        staged: dict[str, torch.Tensor] | None = None
        payload = b""
        staging_error: Exception | None = None
        try:
            with self._hang_exempt():
                staged, payload = self._stage(tensors, replicated, plain)
        except Exception as exc:  # noqa: BLE001 - out of memory, a bad value: skip this one
            self._shards.release()
            self._replicated.release()
            log.warning("sharded snapshot %s skipped on rank %d: staging failed (%s: %s); "
                        "training goes on", sid.name, self.rank, type(exc).__name__, exc)
            staging_error = exc  # the writer thread reports it, after telling the others
        with self._cv:
            self._round = _Round(sid, manifest, staged, payload, staging_error)
            self._busy = True
            if self._thread is None:
                self._thread = threads.start(self._loop, "sharded-snapshot-writer")
            self._cv.notify_all()
        return staged is not None

    def _stage(self, tensors: Mapping[str, torch.Tensor], replicated: Mapping[str, torch.Tensor],
               plain: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
        """Copies of the local shards wrapped back as DTensors (and, on rank 0, copies of
        the replicated tensors), and the encoded plain part."""
        layouts: dict[str, _Layout] = {}
        local: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not isinstance(tensor, DTensor):
                raise TypeError(f"sharded tensor {name!r} is a {type(tensor).__name__}, not a "
                                "DTensor: pass it with the replicated tensors")
            layouts[name] = _Layout(tensor.device_mesh, tuple(tensor.placements), tensor.shape,
                                    tuple(tensor.stride()))
            local[name] = tensor.to_local()
        staged: dict[str, torch.Tensor] = {}
        for name, buf in self._shards.capture(local).items():
            lay = layouts[name]
            # shape= and stride=: with uneven rows the global shape is not local rows x W.
            staged[name] = DTensor.from_local(buf, lay.mesh, lay.placements, run_check=False,
                                              shape=lay.shape, stride=lay.stride)
        payload = b""
        if self.rank == 0:
            clash = staged.keys() & replicated.keys()
            if clash:
                raise ValueError(f"names both sharded and replicated: {sorted(clash)}")
            staged.update(self._replicated.capture(dict(replicated)))
            payload = encode_values(dict(plain), where="sharded snapshot")
        return staged, payload

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until this rank's round has ended; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._busy, timeout)

    def close(self, timeout: float = 0.0) -> None:
        """Stop the thread (after a round in flight, waiting at most ``timeout``). Call it on
        every rank before the dedicated group goes away; a round still running then fails
        in its next collective, and its temporary directory is left to retention."""
        idle = self.wait_idle(timeout)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if idle and thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._round is not None or self._stopped)
                if self._round is None:
                    return
                job = self._round
            try:
                result = self._write(job)
            except BaseException as exc:  # noqa: BLE001 - the writer must survive anything
                log.warning("sharded snapshot %s not written (rank %d): %s", job.sid.name,
                            self.rank, exc)
                if self._listener is not None:
                    self._listener.failed(exc)
            else:
                if result is not None:
                    self.written += 1
                    if self._listener is not None and self.rank == 0:
                        self._listener.written(result)
            with self._cv:
                self._round = None
                self._busy = False
                self._cv.notify_all()

    def _agree(self, ok: bool) -> bool:
        """Collective on the dedicated group: whether every rank says ``ok``."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _write(self, job: _Round) -> Written | None:
        """One round (module docstring, steps 1-4); the published snapshot on rank 0, None
        on the other ranks. Raises when the snapshot was not published."""
        import torch.distributed.checkpoint as dcp

        t0 = time.monotonic()
        tmp: Path | None = None
        ready = job.tensors is not None
        if ready:
            try:
                tmp = self.directory.shared_temp_dir(job.sid)
            except OSError as exc:
                log.warning("sharded snapshot %s: cannot create %s: %s", job.sid.name,
                            self.directory.path, exc)
                ready = False
        if not self._agree(ready):
            self._discard(tmp)
            if job.staging_error is not None:
                raise job.staging_error
            raise RuntimeError("a rank could not stage its shards or create the snapshot "
                               "directory: snapshot skipped on every rank")
        assert job.tensors is not None and tmp is not None
        error: BaseException | None = None
        try:
            # DCP gathers every rank's errors and raises them on every rank: its own
            # collectives stay matched whatever fails inside it.
            dcp.save(job.tensors, process_group=self.group,
                     storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
            if self.rank == 0:
                write_atomic(tmp / PLAIN, job.payload)
        except BaseException as exc:  # noqa: BLE001 - reported after the collective below
            error = exc
        all_ok = self._agree(error is None)
        if error is not None:
            self._discard(tmp)
            raise error
        if not all_ok:
            self._discard(tmp)
            raise RuntimeError("another rank failed to write its shards: snapshot not published")
        if self.rank != 0:
            return None
        assert tmp is not None
        try:
            written = self.directory.publish(tmp, job.manifest)
        except BaseException:
            self._discard(tmp)
            raise
        try:
            removed = tuple(self.directory.prune(self.keep, written=job.sid))
        except OSError as exc:  # the snapshot is written; retention tries again next time
            log.warning("retention after snapshot %s failed: %s", job.sid.name, exc)
            removed = ()
        result = Written(written, self.directory.snapshot_path(job.sid),
                         time.monotonic() - t0, removed)
        log.info("sharded snapshot %s written in %.2f s (%d bytes, %d ranks)", result.path,
                 result.seconds, written.total_bytes, self.world_size)
        return result

    def _discard(self, tmp: Path | None) -> None:
        """Rank 0 removes a failed round's temporary directory (the others may still be
        writing in it until the collective; after it, nobody is)."""
        if self.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_sharded(directory: SnapshotDir, sid: SnapshotId, targets: Mapping[str, torch.Tensor],
                 replicated_targets: Mapping[str, torch.Tensor], *,
                 device: torch.device | None = None) -> dict[str, Any]:
    """Collective over the default group at the current world size: load sharded snapshot
    ``sid`` into live tensors and return its decoded plain part.

    ``targets``: DTensors of the current mesh by the names they were written under (any
    world size or mesh: DCP reads each rank's rows from whichever files hold them), loaded
    in place; the optimizer's state tensors must exist already (create them, e.g. zeros
    like the parameters, before loading). ``replicated_targets``: plain tensors, loaded in
    place with the values rank 0 wrote. Every rank passes the same names.

    First every rank checks the snapshot: present and complete, a sharded snapshot, its
    plain part readable, and a share of its files' checksums (rank r checks every W-th
    file, so each file is read once). The ranks agree on the outcome before loading, so
    all raise alike: :class:`~peer_elastic.durable.layout.CorruptSnapshot` for a missing,
    torn or corrupt snapshot (the caller sets it aside and falls back to an older one),
    :class:`ShardedLoadError` for one that is whole but does not load into these targets
    (not a sharded snapshot, or a tensor missing or of another shape: the caller falls back
    without setting it aside). A failed load may
    have filled some targets: the caller restores or rebuilds them. ``device``: where the
    agreement's flags live (the default group's device; CPU by default).
    """
    everything = {**targets, **replicated_targets}
    if len(everything) != len(targets) + len(replicated_targets):
        raise ValueError("a name is both in targets and in replicated_targets")
    with directory.reading(sid):
        plain = check_sharded(directory, sid, device=device)
        load_checked(directory, sid, everything)
    return plain


def check_sharded(directory: SnapshotDir, sid: SnapshotId, *,
                  device: torch.device | None = None) -> dict[str, Any]:
    """Collective over the default group: check snapshot ``sid`` (see :func:`load_sharded`)
    and return its decoded plain part, or raise the same error on every rank. Lets a caller
    read the plain part (what tensors to build) before it makes the targets."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_error: CorruptSnapshot | ShardedLoadError | None = None
    plain: dict[str, Any] = {}
    try:
        plain = _check(directory, sid, rank, world)
    except (CorruptSnapshot, ShardedLoadError) as exc:
        local_error = exc
    # Per rank: 0 fine, 1 not a sharded snapshot, 2 missing or corrupt; summed, every
    # rank has every rank's answer.
    found = torch.zeros(world, dtype=torch.int64, device=device)
    found[rank] = 0 if local_error is None else \
        1 if isinstance(local_error, ShardedLoadError) else 2
    dist.all_reduce(found)
    answers = [int(f) for f in found.tolist()]
    if any(answers):
        if local_error is not None:
            raise local_error
        bad = [r for r, f in enumerate(answers) if f]
        if max(answers) == 2:
            raise CorruptSnapshot(f"{sid.name}: rank(s) {bad} found it missing or corrupt")
        raise ShardedLoadError(f"{sid.name}: rank(s) {bad} found no sharded snapshot")
    return plain


def load_checked(directory: SnapshotDir, sid: SnapshotId,
                 targets: Mapping[str, torch.Tensor]) -> None:
    """Collective over the default group: DCP's load of a snapshot :func:`check_sharded`
    passed into ``targets`` (sharded and replicated alike), in place."""
    import torch.distributed.checkpoint as dcp

    try:
        with torch.no_grad():
            dcp.load(dict(targets),
                     storage_reader=dcp.FileSystemReader(directory.snapshot_path(sid)))
    except CheckpointException as exc:  # raised on every rank alike
        raise ShardedLoadError(f"snapshot {sid.name} did not load: {exc}") from exc


def _check(directory: SnapshotDir, sid: SnapshotId, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of checking ``sid`` before loading it (see :func:`load_sharded`):
    its plain part, decoded."""
    manifest = directory.complete(sid)
    if not manifest.sharded:  # whole, and loadable: just not by this path (not set aside)
        raise ShardedLoadError(f"{sid.name}: not a sharded snapshot (written by one rank with "
                               "the replicated state): load it with the replicated path")
    path = directory.snapshot_path(sid)
    for name in sorted(manifest.files)[rank::world]:
        try:
            got = file_entry(path / name)
        except OSError as exc:
            raise CorruptSnapshot(f"{sid.name}/{name}: {exc.strerror}") from None
        if got != manifest.files[name]:
            raise CorruptSnapshot(f"{sid.name}/{name}: size or checksum differs from the "
                                  "manifest")
    try:
        return decode_values((path / PLAIN).read_bytes())
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"{sid.name}/{PLAIN}: {exc}") from None
