"""Durable snapshots as one peer uses them: the writer, the resume hook, the etcd records.

A peer's state keeping (:class:`peer_elastic.state_keeping.StateKeeping`) owns one
:class:`DurableSnapshots` when the job has a ``snapshot_dir``: it calls
:meth:`~DurableSnapshots.after_commit` after each commit on rank 0 and hands
:meth:`~DurableSnapshots.resumer` to the state agreement. What the service reports goes to
the peer's counters (:class:`Counters`) and to etcd's snapshot records.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.durable.resume import resume
from peer_elastic.durable.writer import SnapshotInfo, SnapshotWriter, Written
from peer_elastic.errors import PeerElasticError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.snapshot_records import forget_snapshots, record_snapshot
from peer_elastic.records import JobConfig, SnapshotRecord
from peer_elastic.state.agreement import Agreement, Claim, StateVersion

__all__ = ["Counters", "DurableSnapshots"]

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 300.0
DEFAULT_KEEP = 3


class Counters(Protocol):
    """Where the writer thread counts snapshots written, failed and skipped (the peer's
    :class:`~peer_elastic.observer.PeerStats`)."""

    def count(self, name: str) -> None: ...


class _Listener:
    """The writer thread's reports: counters, and the etcd records (never raises)."""

    def __init__(self, client: EtcdClient | None, job: str, stats: Counters) -> None:
        self._client, self._job, self._stats = client, job, stats
        self._host = socket.gethostname()

    def written(self, result: Written) -> None:
        self._stats.count("snapshots_written")
        if self._client is None:
            return
        m = result.manifest
        rec = SnapshotRecord(name=m.id.name, path=os.path.abspath(result.path),
                             commits=m.id.commits, epoch=m.epoch, step=m.step, unix=m.unix,
                             checksum=m.digest(), run_id=m.run_id, bytes=m.total_bytes,
                             host=self._host)
        try:
            record_snapshot(self._client, self._job, rec)
            forget_snapshots(self._client, self._job, [s.name for s in result.removed])
        except (PeerElasticError, OSError) as exc:
            log.warning("snapshot %s written, but its etcd record not: %s", m.id.name, exc)

    def failed(self, error: BaseException) -> None:
        self._stats.count("snapshots_failed")

    def skipped(self) -> None:
        self._stats.count("snapshots_skipped")


class DurableSnapshots:
    """The durable snapshots of one peer's job (see :mod:`peer_elastic.durable`)."""

    def __init__(self, config: JobConfig, job: str, stats: Counters,
                 client: EtcdClient | None = None,
                 hang_exempt: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.directory = SnapshotDir(config.snapshot_dir, job)
        # A run record from before these settings existed reads 0: the defaults then.
        every = config.snapshot_every_s if config.snapshot_every_s > 0 else DEFAULT_EVERY_S
        keep = config.snapshot_keep if config.snapshot_keep > 0 else DEFAULT_KEEP
        self.every_s, self.keep = every, keep
        self.listener = _Listener(client, job, stats)
        # hang_exempt: the staging copy on the training thread is not a hang (liveness)
        self.hang_exempt = hang_exempt
        self.writer = SnapshotWriter(self.directory, every, keep, listener=self.listener,
                                     hang_exempt=hang_exempt)

    @classmethod
    def for_job(cls, config: JobConfig | None, job: str, stats: Counters,
                client: EtcdClient | None = None,
                hang_exempt: Callable[[], AbstractContextManager[None]] | None = None,
                ) -> DurableSnapshots | None:
        """None when the job has no ``snapshot_dir``."""
        if config is None or not config.snapshot_dir:
            return None
        return cls(config, job, stats, client, hang_exempt)

    def after_commit(self, state: Any, info: SnapshotInfo, force: bool = False) -> bool:
        """On rank 0, right after a commit: start a snapshot if one is due."""
        return self.writer.offer(state, info, force=force)

    def final(self, state: Any, info: SnapshotInfo, timeout: float = 120.0) -> bool:
        """A snapshot of the live state now, whatever the interval, and wait for it (a
        graceful stop: nothing done since the last snapshot is lost). Returns whether it was
        written."""
        writer = self.writer
        writer.wait_idle(timeout)  # a write in flight holds the staging buffers
        before = writer.written
        if not writer.offer(state, info, force=True):
            return False
        return writer.wait_idle(timeout) and writer.written > before

    def newest_version(self) -> StateVersion | None:
        """The version of the newest complete snapshot this peer can see (for its claim)."""
        newest = self.directory.newest_complete(sharded=False)
        return newest.id.version if newest is not None else None

    def resumer(self, state: Any, generation: int,
                device: torch.device) -> Callable[[Sequence[Claim]], Agreement | None]:
        return lambda claims: resume(state, self.directory, generation, device, claims)

    def close(self, timeout: float = 0.0) -> None:
        self.writer.close(timeout)
