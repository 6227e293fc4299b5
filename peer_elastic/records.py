"""Encoding and validation of every record peer-elastic keeps in etcd.

Anything under the job prefix may have been written by someone else (an older or newer
peer, an operator with etcdctl, a bug). Decoding is therefore validation: a value that is
not a well-formed record of the expected type raises :class:`RecordError`, which readers
report once per key and otherwise ignore. Nothing read from etcd is ever unpickled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from peer_elastic.errors import RecordError
from peer_elastic.proto.records_pb2 import (
    AckRecord,
    DoneCause,
    DoneRecord,
    DrainRecord,
    EventRecord,
    FenceCause,
    FenceRecord,
    GenerationCause,
    GenerationRecord,
    HostRecord,
    JobConfig,
    MemberRecord,
    PaceRecord,
    PeerPace,
    ProgressRecord,
    ReachRecord,
    RunRecord,
    SnapshotRecord,
    StateRecord,
)
from peer_elastic.setting_rules import setting_problem
from peer_elastic.settings_table import JOB_SETTINGS

__all__ = [
    "SCHEMA", "AckRecord", "DoneCause", "DoneRecord", "DrainRecord", "EventRecord", "FenceCause",
    "FenceRecord", "GenerationCause", "GenerationRecord",
    "HostRecord", "JobConfig", "MemberRecord", "PaceRecord", "PeerPace", "ProgressRecord", "ReachRecord", "RunRecord",
    "SnapshotRecord", "StateRecord",
    "encode", "decode", "valid_name",
]

#: Schema version written into every record. Readers accept versions up to this one;
#: a newer record means a newer peer-elastic wrote it, and the error says so.
SCHEMA = 1

M = TypeVar("M", bound=Message)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
MAX_RECORD_BYTES = 1 << 20  # etcd's default request limit is 1.5 MiB


def valid_name(name: str) -> bool:
    """Job names, member ids, run ids and host names used in keys: no '/', bounded length."""
    # fullmatch: "$" would also accept a trailing newline, which then reaches a key.
    return _NAME.fullmatch(name) is not None


def encode(record: Message) -> bytes:
    """Serialise ``record``, stamping the schema version."""
    if hasattr(record, "schema") and not record.schema:
        record.schema = SCHEMA
    data = record.SerializeToString()
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(
            f"{type(record).__name__} is {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte "
            "limit for one etcd value"
        )
    return data


def decode(cls: type[M], data: bytes, key: str = "?") -> M:
    """Parse and validate ``data`` as ``cls``; raise :class:`RecordError` naming ``key``."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{key}: value of {len(data)} bytes is too large for a record")
    record = cls()
    try:
        record.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise RecordError(f"{key}: not a {cls.__name__}: {exc}") from None
    schema = getattr(record, "schema", SCHEMA)
    if schema == 0:
        raise RecordError(f"{key}: not a {cls.__name__} (no schema version)")
    if schema > SCHEMA:
        raise RecordError(
            f"{key}: {cls.__name__} schema {schema} is newer than this peer-elastic "
            f"understands ({SCHEMA}); upgrade this peer"
        )
    _validate(record, key)
    return record


#: Job settings added after the first run records were written. Such a record reads 0 (or an
#: empty text) for them, which means "the default": no peer could have been started with it.
_ADDED_LATER = tuple(f for f in JOB_SETTINGS if f.name in (
    "snapshot_every_s", "snapshot_keep", "straggler_policy", "straggler_threshold",
    "straggler_window_s", "straggler_cooldown_s"))


def _fill_settings_added_later(cfg: JobConfig) -> None:
    for f in _ADDED_LATER:
        if not getattr(cfg, f.name):
            setattr(cfg, f.name, f.default)


def _validate(record: Message, key: str) -> None:
    rule = _RULES.get(type(record))
    problem = rule(record) if rule is not None else None
    if problem is not None:
        raise RecordError(f"{key}: invalid {type(record).__name__}: {problem}")


def _member_problem(record: MemberRecord) -> str | None:
    if not valid_name(record.member_id):
        return f"member id {record.member_id!r}"
    if record.lease_id == 0:
        return "no lease id"
    # The host names keys (failures/<host>, blacklist/<host>): a "/" would escape them.
    if not valid_name(record.host):
        return f"host {record.host!r}"
    return None


def _generation_problem(record: GenerationRecord) -> str | None:
    if record.number == 0:
        return "generation number 0"
    if len(set(record.roster)) != len(record.roster):
        return "duplicate member in roster"
    if not all(valid_name(m) for m in record.roster):
        return "malformed member id in roster"
    # A cause this peer does not know is a newer writer's: kept, and read as "other".
    if GenerationCause.GENERATION_CAUSE_UNSPECIFIED in record.causes:
        return "unspecified generation cause"
    if len(set(record.causes)) != len(record.causes):
        return "duplicate generation cause"
    return None


def _run_problem(record: RunRecord) -> str | None:
    if not valid_name(record.run_id):
        return f"run id {record.run_id!r}"
    if record.lease_id == 0:
        return "no run lease"
    _fill_settings_added_later(record.config)
    # The same rules as the settings a peer is started with: a value no peer could be
    # started with is no more acceptable written straight into etcd.
    problem = setting_problem(record.config)
    if problem is not None:
        return str(problem)
    return None


def _snapshot_problem(record: SnapshotRecord) -> str | None:
    # The name is a key segment and a directory name: no "/" and no "..".
    if not valid_name(record.name) or not record.name.startswith("snap-"):
        return f"snapshot name {record.name!r}"
    if not record.path or "\0" in record.path:
        return "no snapshot path"
    if not math.isfinite(record.unix):
        return f"unix={record.unix}"
    if len(record.checksum) != 64 or any(c not in "0123456789abcdef" for c in record.checksum):
        return "checksum is not a sha256 hex digest"
    return None


def _state_problem(record: StateRecord) -> str | None:
    if not record.commits:
        return "no commits (the record is written only after one)"
    if not math.isfinite(record.unix):
        return f"unix={record.unix}"
    if not valid_name(record.written_by):
        return f"writer {record.written_by!r}"
    return None


def _ack_or_drain_problem(record: AckRecord | DrainRecord) -> str | None:
    if not valid_name(record.member_id):
        return f"member id {record.member_id!r}"
    return None


def _fence_problem(record: FenceRecord) -> str | None:
    if not valid_name(record.member_id):
        return f"member id {record.member_id!r}"
    # proto3 enums are open: a number this peer does not know parses without error.
    if record.cause == FenceCause.FENCE_CAUSE_UNSPECIFIED or \
            record.cause not in FenceCause.values():
        return f"unknown fence cause {record.cause}"
    return None


def _reach_problem(record: ReachRecord) -> str | None:
    if not valid_name(record.member_id):
        return f"member id {record.member_id!r}"
    if not record.unreachable:
        return "no unreachable member (the record is deleted instead)"
    if not all(valid_name(m) for m in record.unreachable):
        return "malformed member id among the unreachable"
    if len(set(record.unreachable)) != len(record.unreachable):
        return "duplicate unreachable member"
    if record.member_id in record.unreachable:
        return "a member reports itself unreachable"
    return None


def _pace_problem(record: PaceRecord) -> str | None:
    if not math.isfinite(record.unix) or not math.isfinite(record.step_s) \
            or record.step_s < 0:
        return f"unix={record.unix}, step_s={record.step_s}"
    ids = [p.member_id for p in record.peers]
    if not all(valid_name(m) for m in ids) or len(set(ids)) != len(ids):
        return "malformed or duplicate member id"
    for p in record.peers:
        if not all(math.isfinite(v) and v >= 0 for v in (p.score, p.own_s, p.waited_s)):
            return (f"{p.member_id}: score={p.score}, own_s={p.own_s}, "
                    f"waited_s={p.waited_s}")
    return None


#: The rules each kind of record obeys beyond its protobuf schema: a problem, or None.
_RULES: dict[type[Message], Callable[[Any], str | None]] = {
    MemberRecord: _member_problem,
    GenerationRecord: _generation_problem,
    RunRecord: _run_problem,
    SnapshotRecord: _snapshot_problem,
    StateRecord: _state_problem,
    AckRecord: _ack_or_drain_problem,
    DrainRecord: _ack_or_drain_problem,
    FenceRecord: _fence_problem,
    ReachRecord: _reach_problem,
    PaceRecord: _pace_problem,
}
