"""The etcd records of durable snapshots: ``/peer-elastic/<job>/snapshots/<name>``.

Job level and without a lease: a job resumed after losing every peer is a new run, and the
snapshots it may resume from were written by an older one. The files on disk (their
manifests) are what resuming trusts; these records tell operators and tools
(``peer-elastic snapshots``, ``peer-elastic status``) what exists without access to the
snapshot directory. Written by the snapshot writer's thread after the manifest is in place,
deleted when retention deletes the files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from peer_elastic.errors import RecordError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import JobKeys
from peer_elastic.records import SnapshotRecord, decode, encode

__all__ = ["forget_snapshots", "list_snapshots", "record_snapshot"]

log = logging.getLogger(__name__)


def record_snapshot(client: EtcdClient, job: str, record: SnapshotRecord) -> None:
    client.put(JobKeys(job).snapshot(record.name), encode(record))


def forget_snapshots(client: EtcdClient, job: str, names: Iterable[str]) -> None:
    keys = JobKeys(job)
    for name in names:
        client.delete(keys.snapshot(name))


def list_snapshots(client: EtcdClient, job: str) -> list[SnapshotRecord]:
    """The job's snapshot records, oldest first (names sort by commits, then time); invalid
    records are skipped with a warning."""
    kvs, _ = client.get_prefix(JobKeys(job).snapshots_prefix)
    out = []
    for kv in kvs:
        try:
            out.append(decode(SnapshotRecord, kv.value, kv.key))
        except RecordError as exc:
            log.warning("%s", exc)
    return sorted(out, key=lambda r: r.name)
