"""Operator commands on a running job: drain, settings, status. No torch, no membership.

``peer-elastic drain``, ``set``, ``pause``, ``resume`` and ``status`` call these; the CLI
only parses arguments and formats what they return.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from peer_elastic.config import JOB_FIELDS, validate
from peer_elastic.errors import ConfigError, EtcdError, JobNotFound, PeerElasticError
from peer_elastic.etcd.client import EtcdClient, KeyValue, Txn
from peer_elastic.etcd.keys import JobKeys, RunKeys
from peer_elastic.etcd.snapshot_records import list_snapshots
from peer_elastic.etcd.view import JobView, ViewSnapshot
from peer_elastic.records import (
    DrainRecord,
    EventRecord,
    JobConfig,
    PeerPace,
    RunRecord,
    SnapshotRecord,
    decode,
    encode,
    valid_name,
)

#: Settings that can change while a job runs. Lease TTLs cannot: leases are already granted.
RUNTIME_SETTINGS = frozenset({
    "min_np", "max_np", "join_timeout_s", "elastic_timeout_s", "reset_limit", "blacklist_after",
    "blacklist_cooldown_s", "settle_s", "start_settle_s", "paused",
    # read from the watched run record at every look of the hang detector
    "hang_timeout_s", "hang_first_step_s",
    # read from the watched run record at every exchange of paces (peer_elastic.straggler)
    "straggler_policy", "straggler_threshold", "straggler_window_s", "straggler_cooldown_s",
})


def current_run(client: EtcdClient, job: str) -> tuple[RunRecord, KeyValue]:
    """``job``'s current run record (and its key-value, for a compare-and-swap)."""
    kv = client.get(JobKeys(job).run_key)
    if kv is None:
        raise JobNotFound(f"job {job!r} has no running run")
    return decode(RunRecord, kv.value, kv.key), kv


def drain(client: EtcdClient, job: str, member_id: str, requested_by: str = "operator") -> None:
    """Ask ``member_id`` to leave gracefully (what ``peer-elastic drain`` does)."""
    run, _ = current_run(client, job)
    keys = RunKeys(job, run.run_id)
    if not valid_name(member_id) or client.get(keys.member(member_id)) is None:
        raise ConfigError(f"job {job!r} has no member {member_id!r} (see peer-elastic status)")
    rec = DrainRecord(member_id=member_id, requested_by=requested_by, unix=time.time())
    event = EventRecord(kind="drain requested", member_id=member_id, unix=time.time(),
                        detail=f"by {requested_by}")
    client.txn([], [
        Txn.put(keys.drain(member_id), encode(rec), run.lease_id),
        Txn.put(keys.event(member_id), encode(event), run.lease_id),
    ])


def drain_all(client: EtcdClient, job: str, requested_by: str = "operator") -> list[str]:
    """Ask every member to leave gracefully: a stop of the whole job with nothing lost (the
    job is not marked done; rank 0 writes a final durable snapshot when the job has a
    ``snapshot_dir``, and a later start resumes from it). Returns the member ids drained."""
    run, _ = current_run(client, job)
    keys = RunKeys(job, run.run_id)
    kvs, _ = client.get_prefix(keys.prefix + "members/")
    members = sorted(m for kv in kvs if valid_name(m := kv.key.rsplit("/", 1)[-1]))
    if not members:
        raise ConfigError(f"job {job!r} has no members to drain")
    now = time.time()
    ops = []
    for member_id in members:
        rec = DrainRecord(member_id=member_id, requested_by=requested_by, unix=now)
        ops.append(Txn.put(keys.drain(member_id), encode(rec), run.lease_id))
    event = EventRecord(kind="drain requested", member_id="operator", unix=now,
                        detail=f"all {len(members)} members, by {requested_by}")
    ops.append(Txn.put(keys.event("operator"), encode(event), run.lease_id))
    client.txn([], ops)
    return members


#: The largest whole-number setting a run record holds (its fields are uint32).
_UINT32_MAX = 2**32 - 1
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(name: str, value: str) -> bool:
    """``paused=true`` and its spellings; anything else is refused, never read as false."""
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r}: expected true or false (1/0, yes/no, on/off)")


def _parse_changes(changes: Mapping[str, object]) -> dict[str, object]:
    """Check that ``changes`` name runtime settings and convert their values."""
    kinds = {f.name: f.kind for f in JOB_FIELDS} | {"paused": bool}
    out: dict[str, object] = {}
    for name, value in changes.items():
        if name not in kinds:
            raise ConfigError(f"unknown setting {name!r}; settable: {sorted(RUNTIME_SETTINGS)}")
        if name not in RUNTIME_SETTINGS:
            raise ConfigError(f"{name} cannot change while the job runs (leases already hold it)")
        kind = kinds[name]
        try:
            if kind is bool and isinstance(value, str):
                out[name] = _parse_bool(name, value)
            else:
                out[name] = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} is not a valid {kind.__name__}") from None
        if kind is int and not 0 <= out[name] <= _UINT32_MAX:  # type: ignore[operator]
            raise ConfigError(f"{name}={value!r}: must be a whole number from 0 to "
                              f"{_UINT32_MAX}")
    return out


def update_config(client: EtcdClient, job: str, changes: Mapping[str, object],
                  requested_by: str = "operator") -> JobConfig:
    """Change settings of a running job (``peer-elastic set``, ``pause``, ``resume``).

    Peers read the settings from the watched run record, so the change takes effect at
    their next step, with no restart. Compare-and-swap on the run record; retried when a
    peer or another operator changed it meanwhile.
    """
    parsed = _parse_changes(changes)
    run_key = JobKeys(job).run_key
    for _attempt in range(10):
        run, kv = current_run(client, job)
        for name, value in parsed.items():
            setattr(run.config, name, value)
            if name not in run.overridden:
                run.overridden.append(name)
        validate(run.config)
        keys = RunKeys(job, run.run_id)
        detail = ", ".join(f"{k}={getattr(run.config, k)}" for k in changes)
        event = EventRecord(kind="settings changed", unix=time.time(),
                            detail=f"{detail} (by {requested_by})")
        ok, _ = client.txn([Txn.mod(run_key) == kv.mod_revision], [
            Txn.put(run_key, encode(run), run.lease_id),
            Txn.put(keys.event("operator"), encode(event), run.lease_id),
        ])
        if ok:
            return run.config
    raise PeerElasticError(f"job {job!r}: the run record kept changing; settings not applied")


def job_status(client: EtcdClient, job: str) -> dict[str, Any]:
    """The ``status --json`` document (a stable schema; see the README)."""
    view = JobView(client, job).start()
    try:
        snap = view.snapshot()
    finally:
        view.stop()
    if snap.run is None:
        raise JobNotFound(f"job {job!r} has no running run (unknown job, or it ended long ago)")
    doc = status_document(job, snap, time.time(), last_seen(client, snap))
    snapshots = list_snapshots(client, job)
    doc["snapshot"] = snapshot_document(snapshots[-1]) if snapshots else None
    return doc


def snapshot_document(rec: SnapshotRecord) -> dict[str, Any]:
    """One snapshot record as ``status --json`` and ``snapshots --json`` show it."""
    return {"name": rec.name, "path": rec.path, "commits": rec.commits, "epoch": rec.epoch,
            "step": rec.step, "unix": rec.unix, "checksum": rec.checksum, "run_id": rec.run_id,
            "bytes": rec.bytes, "host": rec.host}


def last_seen(client: EtcdClient, snap: ViewSnapshot) -> dict[str, int | None]:
    """Seconds since each member last kept its lease alive (None: its lease is gone).

    The lease is the member's proof of life: a peer refreshes it about every TTL/3 from a
    thread of its own, and the key ends when it stops. So this is the truthful "last seen"
    (to the second, as etcd counts TTLs), not an acknowledgement of training progress."""
    out: dict[str, int | None] = {}
    for m in snap.by_age:
        try:
            out[m.id] = client.lease_since_keepalive(m.lease) if m.lease else None
        except EtcdError:
            out[m.id] = None
    return out


def status_document(job: str, snap: ViewSnapshot, now: float,
                    seen: Mapping[str, int | None] | None = None) -> dict[str, Any]:
    """:func:`job_status` of the picture ``snap`` at wall-clock ``now``; ``seen`` is
    :func:`last_seen` (members missing from it show ``last_seen_s`` None)."""
    assert snap.run is not None
    gen = snap.generation
    roster = list(gen.roster) if gen else []
    eligible = snap.eligible()
    paces = {p.member_id: p for p in snap.pace.peers} if snap.pace is not None else {}
    members = [{
        "id": m.id,
        "host": m.host,
        "address": m.record.address,  # where to scrape its metrics ("" when off)
        "net_address": m.record.net_address,  # the IP its process groups use
        "rank": roster.index(m.id) if m.id in roster else None,
        "standby": m.id not in roster,
        "pid": m.record.pid,
        "labels": dict(m.record.labels),  # the peer's own join(labels=...), for its tooling
        "age_s": round(now - m.record.started_unix, 1),
        "draining": m.id in snap.drains,
        # Whom it reports it cannot reach, and whether the others' reports leave it out.
        "unreachable": sorted(snap.unreachable.get(m.id, ())),
        "cut_off": m.id in snap.cut_off(),
        "last_seen_s": (seen or {}).get(m.id),  # since its last lease keep-alive
        # Its straggler score and pace at the group's last exchange (rank 0's pace record;
        # None for a standby and before the first).
        **_pace_fields(paces.get(m.id)),
    } for m in snap.by_age]
    pace = snap.pace
    p = snap.progress
    return {
        "job": job,
        "run_id": snap.run.run_id,
        "generation": gen.number if gen else 0,
        "world_size": len(roster),
        "leader": eligible[0].id if eligible else None,
        "reason": gen.reason if gen else "",
        "resets": max(0, (gen.number if gen else 0) - 1),
        "members": members,
        "progress": None if p is None else {
            "epoch": p.epoch, "batch": p.batch, "step": p.step, "generation": p.generation,
            "world_size": p.world_size, "age_s": round(now - p.unix, 1),
        },
        "pace": None if pace is None else {
            "generation": pace.generation, "step_s": round(pace.step_s, 6),
            "age_s": round(now - pace.unix, 1),
        },
        "done": None if snap.done is None else {
            "success": snap.done.success, "reason": snap.done.reason,
        },
        "config": {f.name: getattr(snap.run.config, f.name) for f in JOB_FIELDS},
        "keys_prefix": RunKeys(job, snap.run.run_id).prefix,
    }


def _pace_fields(pace: PeerPace | None) -> dict[str, float | None]:
    """A member's ``straggler_score``, ``own_s`` and ``waited_s`` (None without a pace)."""
    if pace is None:
        return {"straggler_score": None, "own_s": None, "waited_s": None}
    return {"straggler_score": round(pace.score, 3), "own_s": round(pace.own_s, 6),
            "waited_s": round(pace.waited_s, 6)}
