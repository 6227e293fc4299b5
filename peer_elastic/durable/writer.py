"""Writing durable snapshots of the committed state in the background.

What the training thread pays, at a due commit only: one copy of the state's tensors into
staging buffers (allocated once, refilled with ``copy_``) and the encoding of its plain
values. Everything else (``torch.distributed.checkpoint`` files, checksums, the rename,
retention, the etcd record) happens on one writer thread.

Why the writer never races the next commit: the commit buffers of ``peer_elastic.state.states``
are reused with ``copy_``, so the writer does not read them at all; it reads only its own
staging buffers, and the training thread refills those only while no write is in flight.
A commit that falls due during a write is skipped (counted) and the next commit after the
write takes the snapshot.

Why no process group: a collective from this thread on the training group could interleave
with the training thread's collectives and deadlock or corrupt them. The writer is a single
rank (rank 0 of the current group) writing state that is replicated on every rank, so DCP
runs with ``no_dist=True`` and writes one file; resuming needs no collective either until
the ordinary state sync.

A failed write (disk full, permissions) is logged and counted; training goes on and nothing
in memory is touched. So is a failed staging copy (host memory exhausted, a device error):
that snapshot is skipped, its staging buffers are released, and the next due commit tries
again.

The staging copy runs on the training thread inside ``hang_exempt`` (the hang detector's
:meth:`~peer_elastic.liveness.TrainingLiveness.exempt`): copying a large state may take
longer than ``hang_timeout_s`` and is not a hang.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from peer_elastic.durable.layout import PLAIN, Manifest, SnapshotDir, SnapshotId, write_atomic
from peer_elastic.process import threads
from peer_elastic.state.agreement import StateVersion
from peer_elastic.state.codec import encode_values
from peer_elastic.torch.transport.snapshots import copy_all

__all__ = ["SnapshotInfo", "SnapshotListener", "SnapshotWriter", "Staging", "Written"]

log = logging.getLogger(__name__)

# DCP warns on every no_dist call that it assumes a single process: that is the design here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


class Snapshottable(Protocol):
    commit_count: int

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...


@dataclass(frozen=True)
class SnapshotInfo:
    """Where the state being snapshotted comes from (for the manifest)."""

    run_id: str
    generation: int
    world_size: int
    # The version of the state (peer_elastic.state.agreement): the snapshot's name, which orders
    # it among the others. None: the commit count alone (a snapshot of lineage 0).
    version: StateVersion | None = None

    def snapshot_id(self, commit_count: int) -> SnapshotId:
        version = self.version or StateVersion(commits=commit_count)
        return SnapshotId.of(version, time.time_ns())


@dataclass(frozen=True)
class Written:
    """One snapshot on disk."""

    manifest: Manifest
    path: Path
    seconds: float  # writing it, on the writer thread
    removed: tuple[SnapshotId, ...]  # what retention deleted after it


class SnapshotListener(Protocol):
    """Told by the writer thread what happened (metrics, etcd records). Must not raise."""

    def written(self, result: Written) -> None: ...

    def failed(self, error: BaseException) -> None: ...

    def skipped(self) -> None: ...


class Staging:
    """CPU copies of named tensors, allocated once and refilled with ``copy_``."""

    def __init__(self) -> None:
        self._store: dict[str, torch.Tensor] = {}

    def capture(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        store: dict[str, torch.Tensor] = {}
        dsts, srcs = [], []
        for name, live in tensors.items():
            src = live.detach()
            buf = self._store.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                # Pinned memory makes the device-to-host copy of a GPU tensor faster.
                pin = src.is_cuda
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            store[name] = buf
            dsts.append(buf)
            srcs.append(src)
        self._store = store
        copy_all(dsts, srcs)
        if any(s.is_cuda for s in srcs):
            torch.cuda.synchronize()
        return store

    def release(self) -> None:
        """Drop every buffer (after a failed capture: memory back, the next one allocates)."""
        self._store = {}


class SnapshotWriter:
    """Writes a snapshot of the state at due commits (``offer``), on a thread of its own."""

    def __init__(self, directory: SnapshotDir, every_s: float, keep: int,
                 listener: SnapshotListener | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 hang_exempt: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.directory = directory
        self.every_s = every_s
        self.keep = keep
        self._listener = listener
        self._clock = clock
        # Marks the staging copy as no hang of the training thread (peer_elastic.liveness).
        self._hang_exempt = hang_exempt or contextlib.nullcontext
        self._last = clock()  # the first snapshot is due every_s after the writer exists
        self._staging = Staging()
        self._cv = threading.Condition()
        self._job: tuple[SnapshotId, dict[str, torch.Tensor], bytes, Manifest] | None = None
        self._busy = False
        self._skip_counted = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._unsupported = False
        self.written = 0  # snapshots written by this writer

    def due(self) -> bool:
        return self._clock() - self._last >= self.every_s

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._busy

    def offer(self, state: Snapshottable, info: SnapshotInfo, *, force: bool = False) -> bool:
        """Call right after a commit, on the training thread. If a snapshot is due (or
        ``force``) and no write is in flight, stage the state and start writing it;
        returns whether it did."""
        if self._unsupported or not (force or self.due()):
            return False
        with self._cv:
            if self._stopped:
                return False
            busy, count_skip = self._busy, self._busy and not self._skip_counted
            if count_skip:
                self._skip_counted = True  # one skip per write in flight, not per commit
        if busy:
            if count_skip and self._listener is not None:
                self._listener.skipped()
            return False
        with self._hang_exempt():
            staging = self._stage(state)
        if staging is None:
            return False
        staged, plain, payload = staging
        sid = info.snapshot_id(int(state.commit_count))
        epoch = plain.get("values", {}).get("epoch")
        manifest = Manifest(sid, self.directory.job, info.run_id, info.generation,
                            info.world_size, epoch if type(epoch) is int and epoch >= 0 else 0,
                            int(state.commit_count))
        with self._cv:
            self._job = (sid, staged, payload, manifest)
            self._busy = True
            self._skip_counted = False
            self._last = self._clock()
            if self._thread is None:
                self._thread = threads.start(self._loop, "snapshot-writer")
            self._cv.notify_all()
        return True

    def _stage(self, state: Snapshottable
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any], bytes] | None:
        """Copy the state into the staging buffers (tensors) and encode its plain values;
        None when this snapshot cannot be taken (and then it was said why)."""
        try:
            tensors, plain = state.durable_state()
            payload = encode_values(plain, where="snapshot")
        except (NotImplementedError, TypeError) as exc:
            # A user handler without durable support, or a value the codec cannot write:
            # say so once and stay off rather than failing every commit.
            log.error("durable snapshots are off: %s", exc)
            self._unsupported = True
            return None
        except Exception as exc:  # noqa: BLE001 - whatever the state raised: this one only
            self._staging_failed(exc)
            return None
        try:
            return self._staging.capture(tensors), plain, payload
        except Exception as exc:  # noqa: BLE001 - out of memory, a device error: any of it
            self._staging_failed(exc)
            return None

    def _staging_failed(self, exc: Exception) -> None:
        """Training goes on without this snapshot: the memory the copy took goes back, and
        the next due commit tries again (a transient shortage passes), not every commit."""
        self._staging.release()
        self._last = self._clock()
        log.warning("durable snapshot skipped: copying the state for it failed (%s: %s); "
                    "training goes on, the next one is tried in %g s",
                    type(exc).__name__, exc, self.every_s)
        if self._listener is not None:
            self._listener.failed(exc)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no write is in flight; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._busy, timeout)

    def close(self, timeout: float = 0.0) -> None:
        """Stop the thread (after a write in flight, waiting at most ``timeout``). An idle
        thread has ended on return; one still writing ends after its write."""
        idle = self.wait_idle(timeout)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if idle and thread is not None and thread is not threading.current_thread():
            thread.join(5.0)  # it only has to see the flag

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._stopped)
                if self._job is None:
                    return
                job = self._job
            try:
                result = self._write(*job)
            except BaseException as exc:  # noqa: BLE001 - the writer must survive anything
                log.warning("durable snapshot %s not written: %s", job[0].name, exc)
                if self._listener is not None:
                    self._listener.failed(exc)
            else:
                log.info("snapshot %s written in %.2f s (%d bytes)", result.path,
                         result.seconds, result.manifest.total_bytes)
                self.written += 1
                if self._listener is not None:
                    self._listener.written(result)
            with self._cv:
                self._job = None
                self._busy = False
                self._cv.notify_all()

    def _write(self, sid: SnapshotId, tensors: dict[str, torch.Tensor], payload: bytes,
               manifest: Manifest) -> Written:
        import torch.distributed.checkpoint as dcp

        t0 = time.monotonic()
        tmp = self.directory.temp_dir(sid)
        try:
            # no_dist: a single writer, no process group (see the module docstring).
            dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                     no_dist=True)
            write_atomic(tmp / PLAIN, payload)
            written = self.directory.publish(tmp, manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            removed = tuple(self.directory.prune(self.keep, written=sid))
        except OSError as exc:  # the snapshot is written; retention tries again next time
            log.warning("retention after snapshot %s failed: %s", sid.name, exc)
            removed = ()
        return Written(written, self.directory.snapshot_path(sid), time.monotonic() - t0,
                       removed)
