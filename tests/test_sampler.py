"""ElasticSampler: partitioning, progress across resets, checkpoints, and the real all-reduce merge."""

from __future__ import annotations

import io
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from peer_elastic.state import TorchState
from peer_elastic.state.sampler import ElasticSampler

# --- helpers ---------------------------------------------------------------------------------


def _sampler(n: int, rank: int, world: int, **kwargs) -> ElasticSampler:
    sampler = ElasticSampler(range(n), **kwargs)
    sampler.set_world(rank, world)
    return sampler


def _shards(n: int, world: int, **kwargs) -> list[list[int]]:
    return [list(_sampler(n, r, world, **kwargs)) for r in range(world)]


def _world_samplers(state: dict | None, n: int, world: int, **kwargs) -> list[ElasticSampler]:
    """One sampler per simulated rank, all loaded from the same committed state."""
    samplers = []
    for r in range(world):
        s = _sampler(n, r, world, **kwargs)
        if state is not None:
            s.load_state_dict(state)
        samplers.append(s)
    return samplers


# --- partitioning ----------------------------------------------------------------------------


_RNG = random.Random(1234)
_SIZES = [
    (0, 1),
    (1, 3),
    (5, 8),
    (7, 7),
    (64, 4),
    *[(_RNG.randint(0, 300), _RNG.randint(1, 8)) for _ in range(25)],
]


@pytest.mark.parametrize(("n", "world"), _SIZES)
@pytest.mark.parametrize("seed", [0, 5])
def test_no_pad_shards_partition_epoch_exactly(n: int, world: int, seed: int) -> None:
    shards = _shards(n, world, seed=seed, pad=False)
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(n))  # every sample exactly once
    lengths = [len(s) for s in shards]
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(("n", "world"), _SIZES)
def test_pad_shards_equal_length_and_cover_epoch(n: int, world: int) -> None:
    shards = _shards(n, world, pad=True)
    per_rank = math.ceil(n / world) if n else 0
    assert [len(s) for s in shards] == [per_rank] * world
    flat = [i for shard in shards for i in shard]
    assert set(flat) == set(range(n))
    assert len(flat) - n == per_rank * world - n  # only the padding repeats


def test_len_matches_iteration_and_horovod_names() -> None:
    s = _sampler(10, 1, 3, pad=True)
    assert len(s) == len(list(s)) == s.num_samples == 4
    assert (s.rank, s.num_replicas) == (1, 3)
    s = _sampler(10, 1, 3, pad=False)
    assert len(s) == 3


def test_permutation_depends_only_on_seed_and_epoch() -> None:
    a = list(_sampler(50, 0, 1, seed=7))
    assert a == list(_sampler(50, 0, 1, seed=7))
    assert a != list(_sampler(50, 0, 1, seed=8))
    assert sorted(a) == list(range(50))
    assert list(_sampler(50, 0, 1, shuffle=False)) == list(range(50))


def test_default_world_without_process_group_is_single_rank() -> None:
    s = ElasticSampler(range(9))
    assert (s.rank, s.num_replicas) == (0, 1)
    assert sorted(s) == list(range(9))


def test_dataloader_uses_the_shard() -> None:
    s = _sampler(20, 1, 2, seed=1)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=4, sampler=s)
    assert [int(x) for batch in loader for x in batch] == list(s)


# --- progress --------------------------------------------------------------------------------


def test_set_epoch_clears_progress_and_changes_permutation() -> None:
    s = _sampler(40, 0, 2, seed=3)
    first = list(s)
    s.record_batch(0, 5)
    assert s.processed_count == 10  # batch 0 of both ranks' shards
    s.set_epoch(1)
    assert s.epoch == 1 and s.processed_count == 0
    assert list(s) != first
    assert len(s.remaining_indices) == 40


@pytest.mark.parametrize("record_all_ranks", [True, False])
def test_set_epoch_of_the_current_epoch_keeps_progress(record_all_ranks: bool) -> None:
    # DistributedSampler's habit: set_epoch(e) at the START of every epoch. After a reset the
    # training function runs again from its top; that call must not wipe what the reset kept.
    s = _sampler(40, 0, 2, seed=3)
    s.record_all_ranks = record_all_ranks
    s.set_epoch(0)  # no progress yet: a fresh start of epoch 0, as before
    before = list(s)
    s.record_batch(0, 5)
    done = s.processed_count
    s.set_epoch(0)
    assert s.epoch == 0 and s.processed_count == done
    assert list(s) == before  # the shard as of the last reset, unchanged
    s.set_epoch(1)  # the next epoch still starts afresh
    assert s.epoch == 1 and s.processed_count == 0


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("new_world", [1, 2, 5])
def test_record_batch_then_reset_to_new_world(pad: bool, new_world: int) -> None:
    n, world, batch = 103, 3, 4
    samplers = _world_samplers(None, n, world, seed=11, pad=pad)
    shards = [list(s) for s in samplers]
    for b in range(5):
        for s in samplers:
            s.record_batch(b, batch)
    processed = {i for shard in shards for i in shard[: 5 * batch]}
    # Global recording: every rank already knows every rank's progress.
    for s in samplers:
        assert set(s.processed_mask.nonzero().flatten().tolist()) == processed

    state = samplers[0].state_dict()
    new_shards = [list(s) for s in _world_samplers(state, n, new_world, seed=11, pad=pad)]
    unprocessed = set(range(n)) - processed
    flat = [i for shard in new_shards for i in shard]
    assert set(flat) == unprocessed
    if not pad:
        assert len(flat) == len(unprocessed)  # no repeats
        lengths = [len(s) for s in new_shards]
        assert max(lengths) - min(lengths) <= 1
    else:
        assert len({len(s) for s in new_shards}) == 1


def test_local_recording_needs_merge() -> None:
    n, world, batch = 50, 2, 3
    samplers = _world_samplers(None, n, world, record_all_ranks=False, pad=False)
    shards = [list(s) for s in samplers]
    for s in samplers:
        s.record_batch(0, batch)
        s.record_batch(1, batch)
    for s, shard in zip(samplers, shards, strict=True):
        assert set(s.processed_mask.nonzero().flatten().tolist()) == set(shard[: 2 * batch])
    # What merge() does across processes: OR of the bitmaps.
    union = samplers[0].processed_mask | samplers[1].processed_mask
    assert int(union.sum()) == 2 * 2 * batch


def test_reset_warns_about_unmerged_local_progress() -> None:
    s = _sampler(10, 0, 2)
    s.record_indices([1])
    with pytest.warns(RuntimeWarning, match="never merged"):
        s.set_world(0, 3)
    s.set_epoch(1)  # progress cleared: nothing left to merge
    s.record_batch(0, 2)  # global recording: every rank knows it
    s.set_world(1, 3)


def test_record_batch_past_the_end_is_clipped() -> None:
    s = _sampler(10, 0, 3, pad=False)
    s.record_batch(1, 3)  # positions 3..5: only rank 0 has a position 3
    assert s.processed_count == 1
    s.record_batch(7, 3)
    assert s.processed_count == 1
    with pytest.raises(ValueError):
        s.record_batch(-1, 3)


def test_record_indices_marks_exactly_those() -> None:
    s = _sampler(10, 0, 1)
    s.record_indices([1, 3, 3])
    s.record_indices(torch.tensor([9]))
    assert s.processed_mask.nonzero().flatten().tolist() == [1, 3, 9]
    with pytest.raises(IndexError):
        s.record_indices([10])
    s.reset()
    assert sorted(s) == [0, 2, 4, 5, 6, 7, 8]


def _simulate_epoch(n: int, batch: int, phases: list[tuple[int, int, bool]], pad: bool) -> Counter:
    """Run one epoch through world changes; count how often each sample is in the committed
    model. A phase is (world, batches, crash): crash restores the last commit first."""
    committed_state, committed_counts = None, Counter()
    for world, batches, crash in [*phases, (1, 10**6, False)]:
        samplers = _world_samplers(committed_state, n, world, seed=5, pad=pad)
        shards = [list(s) for s in samplers]
        counts = Counter(committed_counts)
        for b in range(batches):
            done = [shard[b * batch : (b + 1) * batch] for shard in shards]
            if not any(done):
                break
            for part in done:
                counts.update(part)
            for s in samplers:
                s.record_batch(b, batch)
            if b % 2 == 1 or crash is False:  # commit every other batch (always if graceful)
                committed_state, committed_counts = samplers[0].state_dict(), Counter(counts)
        if not crash:  # graceful change: live state is the committed state
            committed_state, committed_counts = samplers[0].state_dict(), counts
    return committed_counts


def _random_schedule(seed: int) -> tuple[int, int, list[tuple[int, int, bool]]]:
    rng = random.Random(seed)
    phases = [
        (rng.randint(1, 5), rng.randint(0, 6), rng.random() < 0.5) for _ in range(rng.randint(1, 5))
    ]
    return rng.randint(1, 120), rng.randint(1, 6), phases


@pytest.mark.parametrize("case", range(40))
def test_every_sample_counted_exactly_once_through_resets(case: int) -> None:
    n, batch, phases = _random_schedule(case)
    counts = _simulate_epoch(n, batch, phases, pad=False)
    assert counts == Counter(range(n))
    padded = _simulate_epoch(n, batch, phases, pad=True)
    assert set(padded) == set(range(n))


# --- checkpoints -----------------------------------------------------------------------------


def test_state_dict_is_compact_pickle_free_and_round_trips() -> None:
    s = _sampler(1001, 1, 4, seed=9)
    s.set_epoch(2)
    s.record_batch(0, 8)
    s.record_indices([1000])
    sd = s.state_dict()
    assert {k: type(v) for k, v in sd.items()} == {
        "epoch": int,
        "seed": int,
        "num_samples_total": int,
        "processed_bits": torch.Tensor,
    }
    assert sd["processed_bits"].dtype == torch.uint8 and sd["processed_bits"].numel() == 126
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    other = _sampler(1001, 0, 2)  # a different world: progress is world-independent
    other.load_state_dict(loaded)
    assert other.epoch == 2 and other.seed == 9
    assert torch.equal(other.processed_mask, s.processed_mask)
    assert other.processed_count == 4 * 8 + 1


def test_load_state_dict_rejects_other_dataset() -> None:
    sd = _sampler(10, 0, 1).state_dict()
    with pytest.raises(ValueError, match="10 samples"):
        _sampler(11, 0, 1).load_state_dict(sd)


def test_torch_state_commit_restore_and_on_reset_repartition() -> None:
    s = _sampler(30, 0, 2, pad=False)
    state = TorchState(sampler=s, epoch=0)
    assert state.sampler is s
    s.record_batch(0, 5)
    state.commit()
    s.record_batch(1, 5)
    assert s.processed_count == 20
    state.restore()
    assert s.processed_count == 10
    s.set_world(0, 3)  # the loop formed a group of 3; on_reset re-partitions
    state.on_reset()
    assert len(s) == 7 and s.num_replicas == 3


# --- real processes: the all-reduce merge and sync ---------------------------------------------

from tests.helpers.world import run_world as _run_world  # noqa: E402


def _merge_worker(rank: int, world: int, outdir: Path) -> None:
    n = 1000
    s = ElasticSampler(range(n), seed=3, record_all_ranks=False, pad=False)
    assert (s.rank, s.num_replicas) == (rank, world)  # read from the process group
    out: dict[str, torch.Tensor] = {}

    # 1. merge: one all-reduce gives the union of both ranks' progress.
    s.record_indices([i for i in range(n) if i % 7 == rank])
    s.merge()
    out["merged"] = s.processed_mask.clone()

    # 2. sync: rank 1 is in another epoch; it adopts rank 0's epoch and drops its progress.
    s.set_epoch(1)
    s.set_epoch(0)  # epoch 0 again, from nothing (the same epoch alone would keep progress)
    if rank == 0:
        s.record_indices(range(0, 100))
    else:
        s.set_epoch(5)
        s.record_indices(range(500, 600))
    s.sync()
    out["epoch"] = torch.tensor(s.epoch)
    out["synced"] = s.processed_mask.clone()
    out["shard"] = torch.tensor(list(s), dtype=torch.int64)

    # 2b. same epoch, different progress: the source's progress, never a union (progress
    # belongs to the source's model, which everybody adopts with it).
    s.set_epoch(1)
    s.set_epoch(0)
    s.record_indices(range(10) if rank == 0 else range(10, 20))
    s.sync()
    out["adopted"] = s.processed_mask.clone()
    out["local_after_sync"] = torch.tensor(int(s.has_local_progress))

    # 3. a different dataset length fails on every rank, without a hang.
    bad = ElasticSampler(range(n if rank == 0 else n - 1))
    try:
        bad.sync()
    except ValueError:
        out["mismatch_raised"] = torch.tensor(1)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works
    out["after"] = t

    # 4. through TorchState: global record_batch progress survives sync unchanged.
    g = ElasticSampler(range(64), seed=1, pad=True)
    state = TorchState(sampler=g, step=rank)
    g.record_batch(0, 4)
    state.sync()
    out["state_processed"] = g.processed_mask.clone()
    out["state_step"] = torch.tensor(state.step)
    torch.save(out, outdir / f"rank{rank}.pt")


@pytest.mark.slow
def test_merge_and_sync_across_two_processes(tmp_path: Path) -> None:
    _run_world(_merge_worker, 2, tmp_path)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2)]
    expected = torch.tensor([i % 7 in (0, 1) for i in range(1000)])
    for res in r:
        assert torch.equal(res["merged"], expected)
        assert int(res["epoch"]) == 0
        assert res["synced"].nonzero().flatten().tolist() == list(range(100))
        assert res["adopted"].nonzero().flatten().tolist() == list(range(10))
        assert int(res["local_after_sync"]) == 0
        assert int(res["mismatch_raised"]) == 1
        assert float(res["after"]) == 2.0
        assert int(res["state_processed"].sum()) == 8
        assert int(res["state_step"]) == 0
    shards = [res["shard"].tolist() for res in r]
    assert sorted(shards[0] + shards[1]) == list(range(100, 1000))
    assert torch.equal(r[0]["state_processed"], r[1]["state_processed"])
