"""After a reset, ranks agree on the newest commit and sync from whoever holds it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from peer_elastic.elastic import agree_and_sync
from peer_elastic.sampler import ElasticSampler
from peer_elastic.state import TorchState
from tests.helpers.world import run_world as _run_world


def _state(rank: int) -> TorchState:
    torch.manual_seed(rank)
    model = nn.Linear(4, 3)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       sampler=ElasticSampler(range(30), seed=0), epoch=0)
    return state


def _roll_forward(rank: int, world: int, out: Path) -> None:
    # Rank 1 completed one more commit than ranks 0 and 2 (its check collective finished,
    # theirs failed); its commit must win, although it is not rank 0.
    state = _state(rank)
    state.commit()
    if rank == 1:
        state.sampler.record_batch(0, 2)
        state.epoch = 7
        state.commit()
    src = agree_and_sync(state, rank, world, torch.device("cpu"), need=False)
    w = state.model.weight.detach().clone()
    state.model.weight.data.add_(1.0)  # live change after the sync ...
    state.restore()  # ... a failure now must return to the synced state
    (out / f"{rank}.json").write_text(json.dumps({
        "src": src, "commit": state.commit_count, "epoch": state.epoch,
        "processed": state.sampler.processed_count, "w": w.flatten().tolist(),
        "restored_equal": bool(torch.equal(state.model.weight, w)),
    }))


def _removals_only(rank: int, world: int, out: Path) -> None:
    state = _state(0)  # identical everywhere, same commit: nothing to sync
    state.commit()
    src = agree_and_sync(state, rank, world, torch.device("cpu"), need=False)
    (out / f"{rank}.json").write_text(json.dumps({"src": src}))


def test_ranks_adopt_the_newest_commit_from_whichever_rank_holds_it(tmp_path: Path) -> None:
    _run_world(_roll_forward, 3, tmp_path)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert {g["src"] for g in got} == {1}
    assert {g["commit"] for g in got} == {2} and {g["epoch"] for g in got} == {7}
    assert {g["processed"] for g in got} == {6}  # batch 0 of all 3 ranks, 2 samples each
    assert got[0]["w"] == got[1]["w"] == got[2]["w"]
    assert all(g["restored_equal"] for g in got)


def test_identical_commits_and_no_need_skip_the_sync(tmp_path: Path) -> None:
    _run_world(_removals_only, 2, tmp_path)
    assert [json.loads((tmp_path / f"{r}.json").read_text())["src"] for r in range(2)] == [None] * 2
