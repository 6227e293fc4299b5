"""Durable snapshots of sharded state (peer_elastic.durable.sharded): every rank writes its
own FSDP2 shards with DCP on a dedicated gloo group, off the training thread, and the
snapshot loads at another world size or mesh bit-identically.

Real multi-process gloo groups (tests/helpers/world.py), FSDP2 on CPU, a model whose dims
(7 and 3 rows) shard unevenly, Adam after a few steps. One save at W=3 (FSDP) and one at
2x2 (HSDP) are shared by the tests that load them (module fixtures); each test loads a copy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from peer_elastic.durable.layout import (
    MANIFEST,
    METADATA,
    PLAIN,
    CorruptSnapshot,
    Manifest,
    SnapshotDir,
    SnapshotId,
)
from peer_elastic.durable.sharded import (
    ShardedLoadError,
    ShardedSnapshotWriter,
    all_ranks_idle,
    load_sharded,
)
from tests.helpers.world import run_world

JOB = "job-s"
FIRST = SnapshotId(1, 3, 1, 3, 1_000)
SECOND = SnapshotId(1, 4, 1, 4, 2_000)
NEVER = SnapshotId(1, 5, 1, 5, 3_000)  # the round in which a rank's staging copy fails
REPLICATED = SnapshotId(1, 4, 1, 4, 8_000)  # newer than SECOND, written the replicated way
CORRUPT = SnapshotId(1, 4, 1, 4, 9_000)  # newer still: a byte of a shard flipped
PLAIN_VALUES = {"epoch": 2, "sampler": {"seed": 7, "offset": 12}, "name": "fsdp"}


# --- the model, its sharding and its state by stable names (as ShardedState names them) ---

def _mesh(world: int, hsdp: bool) -> DeviceMesh:
    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _model(seed: int, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(4, 5, generator=gen)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model: nn.Module, opt: torch.optim.Optimizer
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(sharded, replicated) tensors by stable name: ``model/<fqn>`` for parameters,
    ``optimizer/<fqn>/<key>`` for optimizer state (``step`` is replicated)."""
    sharded: dict[str, torch.Tensor] = {}
    replicated: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters():
        sharded[f"model/{fqn}"] = p
        for key, value in opt.state[p].items():
            where = sharded if isinstance(value, DTensor) else replicated
            where[f"optimizer/{fqn}/{key}"] = value
    return sharded, replicated


def _empty_adam_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Adam's state tensors on the new mesh, to load into (Adam creates them only at its
    first step)."""
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}


def _gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Collective: the whole state, every sharded tensor gathered (same order everywhere)."""
    sharded, replicated = _state(model, opt)
    out = {name: t.full_tensor().detach().clone() for name, t in sharded.items()}
    out.update({name: t.detach().clone() for name, t in replicated.items()})
    return out


def _busy_anywhere(writer: ShardedSnapshotWriter) -> bool:
    flag = torch.tensor([int(writer.busy())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# --- the workers (one per rank) --------------------------------------------------------------

def _save(rank: int, world: int, out: Path, hsdp: bool) -> None:
    torch.set_num_threads(1)
    mesh = _mesh(world, hsdp)
    model = _model(0, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        _train(model, opt, rank, step)
    group = dist.new_group(backend="gloo")  # the writer's own: every rank, at once
    directory = SnapshotDir(out / "snapshots", JOB)
    writer = ShardedSnapshotWriter(directory, group, keep=1)
    report: dict[str, object] = {}

    # First snapshot.
    first = _gathered(model, opt)
    assert all_ranks_idle(writer)
    sharded, replicated = _state(model, opt)
    assert writer.offer(sharded, replicated, PLAIN_VALUES, FIRST, run_id="r1", generation=1,
                        epoch=2)
    assert writer.busy()
    assert writer.wait_idle(60)
    dist.barrier()
    assert directory.names() == [FIRST]
    first_buffers = [b.data_ptr() for b in writer._shards._store.values()]

    # Second snapshot; the training thread trains on (FSDP collectives and an all-reduce of
    # its own on the default group) while the writer thread writes: the snapshot holds the
    # state as it was offered, and the first one stays complete until the second is.
    _train(model, opt, rank, 3)
    second = _gathered(model, opt)
    assert all_ranks_idle(writer)
    sharded, replicated = _state(model, opt)
    assert writer.offer(sharded, replicated, PLAIN_VALUES, SECOND, run_id="r1", generation=1,
                        epoch=2)
    overlapped, step = 0, 4
    while _busy_anywhere(writer):
        if rank == 0:
            complete = directory.newest_complete(sharded=True)
            assert complete is not None and complete.id in (FIRST, SECOND)
        _train(model, opt, rank, step)
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        assert total.item() == world * (world + 1) / 2
        overlapped += 1
        step += 1
        assert overlapped < 500, "the write never ended"
    report["overlapped"] = overlapped
    assert [b.data_ptr() for b in writer._shards._store.values()] == first_buffers
    assert directory.names() == [SECOND]  # the first pruned (keep=1) once the second was
    live = _gathered(model, opt)
    report["trained_on"] = not torch.equal(live["model/0.weight"], second["model/0.weight"])

    # A round in which one rank's staging copy fails: skipped on every rank, the group stays
    # in step, nothing is published and no temporary directory is left.
    if rank == 1:
        sharded = {**sharded, "model/bad": torch.zeros(3)}  # not a DTensor: staging fails
    assert all_ranks_idle(writer)
    assert writer.offer(sharded, replicated, PLAIN_VALUES, NEVER, run_id="r1", generation=1,
                        epoch=2) == (rank != 1)
    assert writer.wait_idle(60)
    assert _busy_anywhere(writer) is False
    dist.barrier()
    assert directory.names() == [SECOND]
    assert not any(p.name.startswith(".tmp-") for p in directory.path.iterdir())
    writer.close()
    dist.destroy_process_group(group)

    if rank == 0:
        torch.save({"first": first, "second": second}, out / "reference.pt")
        (out / "report.json").write_text(json.dumps(report))


def _load(rank: int, world: int, out: Path, hsdp: bool, expect_corrupt: bool) -> None:
    torch.set_num_threads(1)
    mesh = _mesh(world, hsdp)
    model = _model(1, mesh)  # another init: every loaded value must come from the snapshot
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _empty_adam_state(model, opt)
    sharded, replicated = _state(model, opt)
    directory = SnapshotDir(out / "snapshots", JOB)

    with pytest.raises(CorruptSnapshot, match="no manifest"):
        load_sharded(directory, NEVER, sharded, replicated)  # missing: on every rank alike
    with pytest.raises(ShardedLoadError, match="did not load"):
        load_sharded(directory, SECOND, {**sharded, "model/extra": torch.zeros_like(
            sharded["model/0.weight"])}, replicated)

    newest = directory.newest_complete(sharded=True)
    assert newest is not None
    if expect_corrupt:  # the newest is a corrupt copy: every rank says so, then fall back
        assert newest.id == CORRUPT
        with pytest.raises(ShardedLoadError, match="not a sharded snapshot"):
            load_sharded(directory, REPLICATED, sharded, replicated)
        with pytest.raises(CorruptSnapshot):
            load_sharded(directory, newest.id, sharded, replicated)
        dist.barrier()
        if rank == 0:
            directory.set_aside(newest.id, "test")
        dist.barrier()
        newest = directory.newest_complete(sharded=True)
        assert newest is not None
    assert newest.id == SECOND
    plain = load_sharded(directory, newest.id, sharded, replicated)
    assert plain == PLAIN_VALUES
    loaded = _gathered(model, opt)
    # The loaded optimizer trains on (its state is live, not a copy).
    _train(model, opt, rank, 99)
    assert all(t.item() == loaded[n].item() + 1
               for n, t in _state(model, opt)[1].items())
    if rank == 0:
        want = torch.load(out / "reference.pt")["second"]
        assert list(loaded) == list(want)
        differ = [n for n in want if not torch.equal(loaded[n], want[n])]
        assert not differ, differ


# --- fixtures: one save of each kind, shared --------------------------------------------------

@pytest.fixture(scope="module")
def fsdp3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp3")
    run_world(functools.partial(_save, hsdp=False), 3, out)
    return out


@pytest.fixture(scope="module")
def hsdp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hsdp4")
    run_world(functools.partial(_save, hsdp=True), 4, out)
    return out


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "copy")
    return tmp_path / "copy"


def _newer_copy(directory: SnapshotDir, sid: SnapshotId, newer: SnapshotId) -> Path:
    """A copy of ``sid`` under the newer name ``newer``, with a manifest that matches."""
    target = directory.snapshot_path(newer)
    shutil.copytree(directory.snapshot_path(sid), target)
    manifest = Manifest.from_json((target / MANIFEST).read_bytes())
    (target / MANIFEST).write_bytes(dataclasses.replace(manifest, id=newer).to_json())
    return target


# --- tests -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_rank_writes_its_shards_in_the_background_into_one_complete_snapshot(
        fsdp3: Path) -> None:
    directory = SnapshotDir(fsdp3 / "snapshots", JOB)
    manifest = directory.verify(SECOND)
    assert manifest.sharded and manifest.world_size == 3 and manifest.epoch == 2
    assert manifest.step == SECOND.commits
    assert set(manifest.files) == {METADATA, PLAIN, "__0_0.distcp", "__1_0.distcp",
                                   "__2_0.distcp"}
    report = json.loads((fsdp3 / "report.json").read_text())
    # The training thread ran FSDP steps and all-reduces on the default group while the
    # write was in flight (every sum checked on every rank); the loads below find the state
    # as it was offered, not as trained meanwhile.
    assert report["overlapped"] >= 1 and report["trained_on"]
    ref = torch.load(fsdp3 / "reference.pt")
    assert not torch.equal(ref["first"]["model/0.weight"], ref["second"]["model/0.weight"])


@pytest.mark.slow
def test_a_snapshot_written_at_3_loads_at_2_bit_identically(fsdp3: Path, tmp_path: Path
                                                             ) -> None:
    out = _copy(fsdp3, tmp_path)
    directory = SnapshotDir(out / "snapshots", JOB)
    replicated = _newer_copy(directory, SECOND, REPLICATED)
    manifest = Manifest.from_json((replicated / MANIFEST).read_bytes())
    (replicated / MANIFEST).write_bytes(dataclasses.replace(manifest, sharded=False).to_json())
    bad = _newer_copy(directory, SECOND, CORRUPT)
    with open(bad / "__1_0.distcp", "r+b") as f:  # same size, other bytes: corrupt
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    run_world(functools.partial(_load, hsdp=False, expect_corrupt=True), 2, out)
    assert [p.name for p in directory.path.iterdir() if p.name.startswith("corrupt-")] == \
        [f"corrupt-{bad.name}"]
    assert REPLICATED in directory.names()  # whole, only of the other kind: not set aside


@pytest.mark.slow
def test_a_snapshot_written_at_3_loads_at_4_bit_identically(fsdp3: Path, tmp_path: Path
                                                             ) -> None:
    out = _copy(fsdp3, tmp_path)
    run_world(functools.partial(_load, hsdp=False, expect_corrupt=False), 4, out)


@pytest.mark.slow
def test_an_hsdp_2x2_snapshot_loads_into_fsdp_at_3_bit_identically(hsdp4: Path,
                                                                     tmp_path: Path) -> None:
    out = _copy(hsdp4, tmp_path)
    manifest = SnapshotDir(out / "snapshots", JOB).verify(SECOND)
    assert manifest.sharded and manifest.world_size == 4
    run_world(functools.partial(_load, hsdp=False, expect_corrupt=False), 3, out)


@pytest.mark.slow
def test_an_incomplete_sharded_snapshot_is_ignored(fsdp3: Path, tmp_path: Path) -> None:
    out = _copy(fsdp3, tmp_path)
    directory = SnapshotDir(out / "snapshots", JOB)
    # Torn: every rank's files and the plain part, but rank 0 never published it.
    torn = _newer_copy(directory, SECOND, SnapshotId(1, 9, 1, 9, 9_000))
    (torn / MANIFEST).unlink()
    # Still being written (or its writers died): the shared temporary directory.
    shutil.copytree(directory.snapshot_path(SECOND),
                    directory.shared_temp_dir(SnapshotId(1, 10, 1, 10, 9_000)),
                    dirs_exist_ok=True)
    newest = directory.newest_complete(sharded=True)
    assert newest is not None and newest.id == SECOND
    assert directory.newest_complete(sharded=False) is None  # no replicated snapshot here


def test_a_sharded_manifest_says_so_and_a_replicated_one_is_unchanged(tmp_path: Path) -> None:
    plain = Manifest(FIRST, JOB, "r1", 1, 3, 0, 3)
    assert b"sharded" not in plain.to_json()  # older manifests and digests stay as they were
    assert Manifest.from_json(plain.to_json()) == plain and not plain.sharded
    sharded = dataclasses.replace(plain, sharded=True)
    assert Manifest.from_json(sharded.to_json()) == sharded
    doc = json.loads(sharded.to_json())
    doc["sharded"] = "yes"
    with pytest.raises(ValueError, match="sharded"):
        Manifest.from_json(json.dumps(doc).encode())
    # One temporary directory per id, the same on every rank, never emptied by another.
    directory = SnapshotDir(tmp_path, JOB)
    tmp = directory.shared_temp_dir(FIRST)
    (tmp / "__1_0.distcp").write_bytes(b"x")
    assert directory.shared_temp_dir(FIRST) == tmp and (tmp / "__1_0.distcp").exists()
    assert directory.names() == []
