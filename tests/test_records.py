"""Records: the generated code matches the .proto, and decoding is validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer_elastic.errors import RecordError
from peer_elastic.records import (
    SCHEMA,
    AckRecord,
    DoneRecord,
    GenerationRecord,
    MemberRecord,
    RunRecord,
    StateRecord,
    decode,
    encode,
    valid_name,
)

ROOT = Path(__file__).resolve().parents[1]
ALL = [AckRecord, DoneRecord, GenerationRecord, MemberRecord, RunRecord, StateRecord]


def test_generated_module_matches_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    proto = "peer_elastic/proto/records.proto"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", proto],
        cwd=ROOT, check=True, timeout=60,
    )
    for name in ("records_pb2.py", "records_pb2.pyi"):
        fresh = (tmp_path / "peer_elastic/proto" / name).read_text()
        committed = (ROOT / "peer_elastic/proto" / name).read_text()
        assert fresh == committed, f"{name} is stale: regenerate it (see records.proto)"


def test_round_trip_stamps_schema() -> None:
    rec = MemberRecord(member_id="h-1-abc", host="h", lease_id=7, pid=3)
    back = decode(MemberRecord, encode(rec), "k")
    assert back.schema == SCHEMA and back.member_id == "h-1-abc"


@pytest.mark.parametrize("data, why", [
    (b"\xff\xff\xff", "not a MemberRecord"),
    (b"", "no schema"),
    (encode(MemberRecord(member_id="a/b", lease_id=1)), "member id"),
    (encode(MemberRecord(member_id="ok", lease_id=0)), "no lease"),
    (MemberRecord(schema=SCHEMA + 1, member_id="ok", lease_id=1).SerializeToString(),
     "upgrade this peer"),
])
def test_invalid_member_records_are_rejected_with_the_key(data: bytes, why: str) -> None:
    with pytest.raises(RecordError, match=why) as err:
        decode(MemberRecord, data, "/peer-elastic/j/r/members/x")
    assert "/peer-elastic/j/r/members/x" in str(err.value)


def test_generation_validation() -> None:
    with pytest.raises(RecordError, match="duplicate"):
        decode(GenerationRecord, encode(GenerationRecord(number=2, roster=["a", "a"])))
    with pytest.raises(RecordError, match="number 0"):
        decode(GenerationRecord, encode(GenerationRecord(number=0, roster=["a"])))
    with pytest.raises(RecordError, match="unspecified generation cause"):
        decode(GenerationRecord, encode(GenerationRecord(number=2, causes=[0])))
    with pytest.raises(RecordError, match="duplicate generation cause"):
        decode(GenerationRecord, encode(GenerationRecord(number=2, causes=[1, 1])))
    # Older writers set no causes; a newer writer's cause is kept (and read as "other").
    assert list(decode(GenerationRecord, encode(GenerationRecord(number=2))).causes) == []
    assert list(decode(GenerationRecord, encode(GenerationRecord(number=2, causes=[8, 99])))
                .causes) == [8, 99]


def test_a_generation_record_of_an_older_writer_with_needs_sync_still_decodes() -> None:
    # Field 5 (needs_sync, bool) was written and never read; it is reserved now. Records
    # written before, which carry it, decode the same (protobuf: tag 5 << 3 | varint, 1).
    old = encode(GenerationRecord(number=3, roster=["a", "b"], reason="joined: b",
                                  written_by="a")) + bytes([5 << 3 | 0, 1])
    rec = decode(GenerationRecord, old, "/peer-elastic/j/r/generation")
    assert (rec.number, list(rec.roster), rec.reason, rec.written_by) == \
        (3, ["a", "b"], "joined: b", "a")
    assert "needs_sync" not in GenerationRecord.DESCRIPTOR.fields_by_name


def test_state_record_validation() -> None:
    ok = StateRecord(commits=3, generation=2, unix=1.0, written_by="h-1-abc")
    assert decode(StateRecord, encode(ok)).commits == 3
    for bad, why in [(StateRecord(commits=0, unix=1.0, written_by="h"), "no commits"),
                     (StateRecord(commits=1, unix=float("nan"), written_by="h"), "unix"),
                     (StateRecord(commits=1, unix=1.0, written_by="a/b"), "writer")]:
        with pytest.raises(RecordError, match=why):
            decode(StateRecord, encode(bad), "/peer-elastic/j/r/state")


def test_oversized_record_is_refused_before_it_reaches_etcd() -> None:
    with pytest.raises(RecordError, match="limit"):
        encode(GenerationRecord(number=1, roster=[f"m{i:07d}" for i in range(200_000)]))


@pytest.mark.parametrize("name, ok", [
    ("job-1", True), ("a.b_c", True), ("", False), ("-x", False), ("a/b", False),
    ("x" * 128, True), ("x" * 129, False), ("é", False),
])
def test_valid_name(name: str, ok: bool) -> None:
    assert valid_name(name) is ok


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512), cls=st.sampled_from(ALL))
def test_decoding_random_bytes_never_crashes(data: bytes, cls) -> None:
    try:
        decode(cls, data, "fuzz")
    except RecordError:
        pass


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=200))
def test_truncated_records_are_rejected_or_valid(cut: int) -> None:
    full = encode(GenerationRecord(number=5, roster=["a", "b", "c"], reason="x" * 50))
    try:
        rec = decode(GenerationRecord, full[:cut], "cut")
    except RecordError:
        return
    assert rec.number >= 1
