"""Durable snapshots, fast unit tests: the writer, the manifest, retention, corrupt and torn
snapshots, failed writes (simulated and a real full tmpfs), and resuming in a one-rank gloo
group. The multi-process tests with the exactly-once oracle are in test_durable_resume.py."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import peer_elastic as pe
from peer_elastic.durable.layout import MANIFEST, CorruptSnapshot, SnapshotDir, SnapshotId
from peer_elastic.durable.resume import load_snapshot, resume
from peer_elastic.durable.writer import SnapshotInfo, SnapshotWriter
from peer_elastic.state.agreement import Claim, StateVersion
from tests.helpers.durable import Listener, make_state

INFO = SnapshotInfo("r1-abc", 3, 2)


def train_a_little(state: pe.TorchState, steps: int = 3) -> None:
    for i in range(steps):
        x = torch.randn(5, 4)
        state.optimizer.zero_grad()
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()
        state.scheduler.step()
        state.sampler.record_batch(i, 2)
        state.metric += 1
    state.epoch = 1
    state.notes = {"k": (2, b"yz")}
    state.commit()


def fingerprint(state: pe.TorchState) -> list:
    tensors = [t.clone() for t in state.model.state_dict().values()]
    for s in state.optimizer.state.values():
        tensors += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return [tensors, state.metric.clone(), state.scheduler.state_dict(),
            state.sampler.processed_count, state.epoch, state.notes, state.commit_count]


def same(a: list, b: list) -> bool:
    ta, tb = a[0], b[0]
    return (len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
            and torch.equal(a[1], b[1]) and a[2:] == b[2:])


def flip_a_byte(directory: SnapshotDir, sid: SnapshotId) -> None:
    """One byte of ``sid``'s tensor file flipped: same size, so only the checksum tells."""
    data = next(p for p in directory.snapshot_path(sid).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def write_one(writer: SnapshotWriter, state: pe.TorchState) -> None:
    assert writer.offer(state, INFO, force=True)
    assert writer.wait_idle(60)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_snapshot_round_trip_into_fresh_objects(tmp_path: Path) -> None:
    state = make_state(0)
    train_a_little(state)
    listener = Listener()
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=3, listener=listener)
    want = fingerprint(state)
    write_one(writer, state)
    (result,) = listener.results
    m = result.manifest
    assert result.path == tmp_path / "job-a" / m.id.name
    assert (m.id.commits, m.epoch, m.step, m.run_id, m.generation) == (1, 1, 1, "r1-abc", 3)
    assert directory.verify(m.id) == m and directory.newest_valid() == m
    # plain values are tagged JSON, not pickle
    assert b'"notes"' in (result.path / "plain.json").read_bytes()
    fresh = make_state(7)  # other weights, an optimizer that never stepped
    assert not same(fingerprint(fresh), want)
    load_snapshot(fresh, directory, m.id)
    fresh.commit_count = m.id.commits  # what the state agreement sets
    assert same(fingerprint(fresh), want)
    writer.close()


def test_writer_reads_only_its_staging_copy(tmp_path: Path) -> None:
    # The live state (and the commit buffers) change right after offer(); the snapshot must
    # still be the state at the commit.
    state = make_state(0)
    train_a_little(state)
    want = fingerprint(state)
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=3)
    assert writer.offer(state, INFO, force=True)
    train_a_little(state, 5)  # overwrites live tensors and the commit buffers meanwhile
    assert writer.wait_idle(60)
    fresh = make_state(3)
    m = directory.newest_valid()
    load_snapshot(fresh, directory, m.id)
    fresh.commit_count = m.id.commits
    assert same(fingerprint(fresh), want)


def test_due_interval_busy_skip_and_retention(tmp_path: Path) -> None:
    now = [0.0]
    listener = Listener()
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=10, keep=2, listener=listener,
                            clock=lambda: now[0])
    state = make_state(0)
    assert not writer.offer(state, INFO)  # not due yet
    for _ in range(4):
        now[0] += 10
        state.commit()
        assert writer.offer(state, INFO)
        assert writer.wait_idle(60)
        assert not writer.offer(state, INFO)  # just written: not due
    assert [s.commits for s in directory.names()] == [3, 4]  # the newest two kept
    first = listener.results[0].manifest.id
    assert [tuple(r.removed) for r in listener.results][2] == (SnapshotId(0, 1, 0, 0,
                                                                          first.unix_ns),)
    # A due commit while a write is in flight is skipped and counted, not queued.
    gate = threading.Event()
    real = directory.publish

    def slow_publish(tmp, manifest):  # type: ignore[no-untyped-def]
        gate.wait(30)
        return real(tmp, manifest)

    directory.publish = slow_publish  # type: ignore[method-assign]
    now[0] += 10
    assert writer.offer(state, INFO)
    now[0] += 10
    assert not writer.offer(state, INFO) and listener.skips == 1
    assert not writer.offer(state, INFO) and listener.skips == 1  # one per write in flight
    gate.set()
    assert writer.wait_idle(60)


def test_torn_and_corrupt_snapshots_are_skipped(tmp_path: Path) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=5)
    state = make_state(0)
    for _ in range(3):
        state.commit()
        write_one(writer, state)
    oldest, middle, newest = directory.names()
    # newest: one byte of its tensor file flipped (same size: only the checksum sees it)
    flip_a_byte(directory, newest)
    assert directory.complete(newest)  # looks complete ...
    with pytest.raises(CorruptSnapshot, match="checksum"):
        directory.verify(newest)  # ... but is not
    assert directory.newest_valid().id == middle
    # middle: torn (the writer died before the manifest)
    (directory.snapshot_path(middle) / MANIFEST).unlink()
    assert directory.newest_complete().id == newest
    assert directory.newest_complete(frozenset({newest})).id == oldest
    assert directory.newest_valid().id == oldest


def test_resume_in_a_group_skips_a_corrupt_newest(tmp_path: Path, one_rank_group: None) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=5)
    state = make_state(0)
    train_a_little(state)
    write_one(writer, state)
    want = fingerprint(state)
    train_a_little(state)
    write_one(writer, state)
    newest = directory.names()[-1]
    (directory.snapshot_path(newest) / "plain.json").write_bytes(b"{" * 10)  # size differs
    fresh = make_state(9)
    claims = [Claim(StateVersion(), True, None, 7)]
    agreement = resume(fresh, directory, generation=4, device=torch.device("cpu"),
                       claims=claims)
    assert agreement is not None and agreement.source == 0
    assert agreement.version == StateVersion(7, 1, 4, 0)  # a new lineage, from the proposal
    fresh.commit_count = agreement.version.commits
    assert same(fingerprint(fresh), want)
    assert resume(make_state(1), SnapshotDir(tmp_path, "other-job"), 4,
                  torch.device("cpu"), claims) is None  # jobs sharing a directory never mix


def test_a_failed_write_is_counted_and_training_goes_on(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import peer_elastic.durable.writer as writer_mod

    listener = Listener()
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=3, listener=listener)
    state = make_state(0)
    want = fingerprint(state)

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "write_atomic", full)
    write_one(writer, state)
    assert len(listener.errors) == 1 and not listener.results
    assert directory.names() == [] and not any(directory.path.iterdir())  # no debris
    assert same(fingerprint(state), want)  # nothing in memory touched
    monkeypatch.undo()
    write_one(writer, state)  # the next one works again
    assert len(listener.results) == 1


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True, timeout=10).returncode == 0
    return ok


def test_a_full_disk(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        listener = Listener()
        directory = SnapshotDir(mnt, "job-a")
        writer = SnapshotWriter(directory, every_s=300, keep=3, listener=listener)
        state = pe.TorchState(model=nn.Linear(200, 200))  # 160 kB: does not fit
        write_one(writer, state)
        # torch reports a short write as RuntimeError, the rest as OSError: either is counted
        assert len(listener.errors) == 1 and not listener.results
        assert directory.newest_valid() is None
        state.commit()  # training goes on
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=10)


def test_two_jobs_sharing_a_directory_never_mix(tmp_path: Path) -> None:
    a, b = SnapshotDir(tmp_path, "job-a"), SnapshotDir(tmp_path, "job-b")
    wa = SnapshotWriter(a, every_s=300, keep=1)
    wb = SnapshotWriter(b, every_s=300, keep=1)
    sa, sb = make_state(0), make_state(1)
    for _ in range(3):
        sa.commit()
        write_one(wa, sa)
    sb.commit()
    write_one(wb, sb)
    # Each job's retention kept its own newest; neither touched the other's.
    assert [s.commits for s in a.names()] == [3] and [s.commits for s in b.names()] == [1]
    assert a.newest_valid().job == "job-a" and b.newest_valid().job == "job-b"
    # A snapshot copied into the other job's directory is refused (its manifest says whose).
    import shutil

    shutil.copytree(a.snapshot_path(a.names()[0]), b.path / a.names()[0].name)
    with pytest.raises(CorruptSnapshot, match="job-a"):
        b.verify(a.names()[0])
    assert b.newest_valid().id.commits == 1


def test_snapshot_records_and_keys() -> None:
    from peer_elastic.errors import RecordError
    from peer_elastic.etcd.keys import JobKeys, KeyKind, parse
    from peer_elastic.records import SnapshotRecord, decode, encode

    name = SnapshotId(0, 12, 0, 0, 1_700_000_000_000_000_000).name
    rec = SnapshotRecord(name=name, path="/s/j/" + name, commits=12, epoch=1, step=12,
                         unix=1.7e9, checksum="ab" * 32, run_id="r1-x", bytes=10, host="h")
    assert decode(SnapshotRecord, encode(rec)) == rec
    for bad in (dict(name="../x"), dict(checksum="nope"), dict(path="")):
        broken = SnapshotRecord()
        broken.CopyFrom(rec)
        for k, v in bad.items():
            setattr(broken, k, v)
        with pytest.raises(RecordError):
            decode(SnapshotRecord, encode(broken))
    key = JobKeys("j").snapshot(name)
    assert key == f"/peer-elastic/j/snapshots/{name}"
    parsed = parse(key)
    assert parsed is not None and parsed.kind is KeyKind.SNAPSHOT and parsed.name == name


def test_snapshot_records_in_etcd_beside_a_running_job(etcd: str, unique_job: str) -> None:
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.etcd.snapshot_records import (
        forget_snapshots,
        list_snapshots,
        record_snapshot,
    )
    from peer_elastic.records import SnapshotRecord

    client = EtcdClient(etcd)
    c = Coordinator(client, unique_job, JobSettings(start_settle_s=0.1)).start()
    try:
        c.wait_generation(0, timeout=10)
        names = [SnapshotId(0, n, 0, 0, 1_700_000_000_000_000_000 + n).name for n in (2, 1)]
        for name in names:
            record_snapshot(client, unique_job, SnapshotRecord(
                name=name, path="/x/" + name, unix=1.7e9, checksum="0" * 64, commits=1))
        assert [r.name for r in list_snapshots(client, unique_job)] == sorted(names)
        forget_snapshots(client, unique_job, [names[1]])
        assert [r.name for r in list_snapshots(client, unique_job)] == [names[0]]
        # The job's own watch sees these keys and ignores them: no "malformed" report. (A
        # progress record written after them shows the watch got that far.)
        c.record_progress(epoch=1, batch=1, step=1, generation=1, world_size=1)
        assert c.view.wait_for(lambda s: s.progress is not None, 10) is not None
        assert not [k for k in c.view.malformed if "/snapshots/" in k]
    finally:
        c.close(leave=True)
        client.close()


# --- lineages: names, order, retention --------------------------------------------------------


def info_at(lineage: int, commits: int, generation: int = 3, step: int = 4) -> SnapshotInfo:
    return SnapshotInfo("r1-abc", generation, 2,
                        StateVersion(lineage, commits, generation, step))


def test_snapshot_names_carry_the_version_and_order_by_it() -> None:
    sid = SnapshotId.of(StateVersion(5, 12, 3, 7), 99)
    assert SnapshotId.parse(sid.name) == sid and sid.version == StateVersion(5, 12, 3, 7)
    legacy = SnapshotId.parse("snap-000000000040-00000000000000000001")
    assert legacy == SnapshotId(0, 40, 0, 0, 1) and legacy.name.startswith("snap-0000000000")
    # A later lineage outranks any count of an older one; a final snapshot taken after the
    # last commit (a later step of the same commit) outranks that commit's.
    assert legacy < SnapshotId.of(StateVersion(1, 1, 1, 1), 0)
    assert SnapshotId.of(StateVersion(5, 99, 9, 9), 9) < SnapshotId.of(StateVersion(6, 1, 1, 1), 0)
    assert SnapshotId.of(StateVersion(6, 4, 2, 3), 9) < SnapshotId.of(StateVersion(6, 4, 2, 8), 0)
    assert SnapshotId.parse("snap-" + "0" * 20 + "-000000000001-0000000001-0000000001-" +
                            "0" * 20) is None  # lineage 0 has only the older form
    assert SnapshotId.parse(sid.name + "\n") is None


def test_a_lineage_restarted_lower_keeps_its_own_snapshots(tmp_path: Path) -> None:
    """A reused job name with another model, or a resume from an older snapshot: the new
    lineage's first snapshots count fewer commits than the old ones, and are still kept."""
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=2)
    state = make_state(0)
    for commits in (200, 201, 202):
        assert writer.offer(state, info_at(1, commits), force=True) and writer.wait_idle(60)
    for commits in (1, 2, 3):
        assert writer.offer(state, info_at(2, commits), force=True) and writer.wait_idle(60)
        assert directory.names()[-1].version == StateVersion(2, commits, 3, 4)  # not pruned
    assert [(s.lineage, s.commits) for s in directory.names()] == [(2, 2), (2, 3)]
    assert directory.newest_valid().id.lineage == 2


def test_retention_never_deletes_the_snapshot_just_written(tmp_path: Path) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=1)
    state = make_state(0)
    assert writer.offer(state, info_at(9, 50), force=True) and writer.wait_idle(60)
    # A writer whose lineage ranks below (a clock behind, a branch): what it just wrote stays.
    assert writer.offer(state, info_at(8, 60), force=True) and writer.wait_idle(60)
    assert [s.lineage for s in directory.names()] == [8, 9]


def test_a_corrupt_snapshot_is_set_aside_and_never_the_one_kept(
        tmp_path: Path, one_rank_group: None) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=1)
    state = make_state(0)
    train_a_little(state)
    assert writer.offer(state, info_at(1, 1), force=True) and writer.wait_idle(60)
    want = fingerprint(state)
    # Only a good older one and a corrupt newer one (same size: only the checksum tells).
    good = directory.names()[-1]
    shutil.copytree(directory.snapshot_path(good), directory.path / "keep")
    train_a_little(state)
    assert writer.offer(state, info_at(1, 2), force=True) and writer.wait_idle(60)
    os.rename(directory.path / "keep", directory.snapshot_path(good))
    bad = directory.names()[-1]
    flip_a_byte(directory, bad)
    fresh = make_state(5)
    agreement = resume(fresh, directory, 7, torch.device("cpu"),
                       [Claim(StateVersion(), True, None, 11)])
    assert agreement is not None and agreement.version == StateVersion(11, 1, 7, 0)
    fresh.commit_count = agreement.version.commits
    assert same(fingerprint(fresh), want)
    assert directory.names() == [good]  # the corrupt one no longer counts ...
    assert (directory.path / f"corrupt-{bad.name}").is_dir()  # ... and is kept for a look
    directory.prune(keep=1)
    assert directory.names() == [good]


def test_a_snapshot_being_read_is_not_pruned(tmp_path: Path) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=1)
    state = make_state(0)
    assert writer.offer(state, info_at(1, 1), force=True) and writer.wait_idle(60)
    (old,) = directory.names()
    with directory.reading(old):
        assert writer.offer(state, info_at(1, 2), force=True) and writer.wait_idle(60)
        assert old in directory.names()
    directory.prune(keep=1)
    assert old not in directory.names() and len(directory.names()) == 1
    assert not [e for e in os.listdir(directory.path) if e.startswith(".reading-")]


def test_resume_skips_snapshots_no_newer_than_the_state_held(
        tmp_path: Path, one_rank_group: None) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=3)
    state = make_state(0)
    assert writer.offer(state, info_at(4, 10, 2, 1), force=True) and writer.wait_idle(60)
    held = Claim(StateVersion(4, 10, 5, 9), False, directory.names()[-1].version, 0)
    assert resume(make_state(1), directory, 6, torch.device("cpu"), [held]) is None
    behind = Claim(StateVersion(4, 3, 1, 1), False, directory.names()[-1].version, 0)
    agreement = resume(make_state(1), directory, 6, torch.device("cpu"), [behind])
    assert agreement is not None and agreement.version == StateVersion(5, 10, 6, 0)


def test_an_unreadable_snapshot_directory_means_no_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = SnapshotDir(tmp_path, "job-a")
    directory.path.mkdir()

    def refuse(path: object) -> list[str]:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "listdir", refuse)
    assert directory.names() == [] and directory.newest_complete() is None


def test_a_failed_load_leaves_a_holder_with_what_it_held(
        tmp_path: Path, one_rank_group: None) -> None:
    """A peer that holds trained state loads a newer snapshot that turns out corrupt: the
    group keeps the state that peer held, so the failed load must leave it exactly so."""
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=300, keep=3)
    state = make_state(0)
    train_a_little(state)
    assert writer.offer(state, info_at(4, 9), force=True) and writer.wait_idle(60)
    bad = directory.names()[-1]
    flip_a_byte(directory, bad)
    holder = make_state(3)
    train_a_little(holder)  # its last commit ...
    holder.metric += 5  # ... and live steps after it
    held = fingerprint(holder)
    claim = Claim(StateVersion(4, 2, 1, 1), False, bad.version, 0)
    assert resume(holder, directory, 6, torch.device("cpu"), [claim]) is None
    assert same(fingerprint(holder), held)
    holder.restore()  # its restore point is what it held too
    assert same(fingerprint(holder), held)
