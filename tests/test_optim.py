"""DistributedOptimizer: gradients averaged over the current group, on real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import peer_elastic as pe
from tests.helpers.world import run_world


def _average(rank: int, world: int, out: Path) -> None:
    torch.manual_seed(0)  # same initial weights everywhere
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    extra = nn.Parameter(torch.zeros(5))  # rank 1 never produces a gradient for it
    opt = pe.DistributedOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=1.0),
                                  bucket_bytes=64)  # tiny buckets: several all-reduces
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "AveragingSGD"
    x = torch.full((1, 3), float(rank + 1))
    loss = model(x).sum() + (extra.sum() * 2 if rank == 0 else 0)
    loss.backward()
    local = [p.grad.clone() for p in model.parameters()]
    opt.step()
    (out / f"{rank}.json").write_text(json.dumps({
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "local": [g.flatten().tolist() for g in local],
        "extra": extra.detach().tolist(),
    }))


@pytest.mark.slow
def test_gradients_are_averaged_over_the_group(tmp_path: Path) -> None:
    run_world(_average, 2, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert r0["params"] == r1["params"]  # identical after the step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    for p, g0, g1, got in zip(model.parameters(), r0["local"], r1["local"], r0["params"],
                              strict=True):
        want = p.detach().flatten() - (torch.tensor(g0) + torch.tensor(g1)) / 2
        assert torch.allclose(want, torch.tensor(got))
    assert r0["extra"] == r1["extra"] == [-1.0] * 5  # (2 + 0) / 2, the missing grad as 0


def test_without_a_group_it_is_the_plain_optimizer() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = pe.DistributedOptimizer(torch.optim.SGD([p], lr=0.5))
    assert pe.DistributedOptimizer(opt) is opt  # idempotent
    p.sum().backward()
    opt.step()
    assert p.tolist() == [0.5, 0.5]
    assert "state" in opt.state_dict()


def _gradients_after_step(rank: int, world: int, out: Path) -> None:
    """Gradients after step(): views of the averaged buffer where they were contiguous, the
    same tensor with the average copied in where they were not, correct when accumulated
    into in place (zero_grad(set_to_none=False)), and in buckets per dtype."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)  # non-contiguous grads
    dense = nn.Linear(4, 2)
    wide = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # a bucket of its own dtype
    opt = pe.DistributedOptimizer(torch.optim.SGD([*conv.parameters(), *dense.parameters(),
                                                   wide], lr=0.0))  # lr 0: params stay
    x = torch.full((1, 2, 5, 5), float(rank + 1)).to(memory_format=torch.channels_last)
    report: dict[str, list] = {"avg": [], "kept": [], "shared": []}
    for step in range(3):
        # Steps 1 and 2 accumulate into the previous step's gradients (views, zeroed in
        # place), as gradient accumulation with set_to_none=False does.
        opt.zero_grad(set_to_none=(step == 0))
        scale = float(rank + 1 + step)
        loss = conv(x).sum() * scale + dense(torch.ones(1, 4)).sum() * scale
        loss = loss + (wide * scale).sum()
        loss.backward()
        before = {name: p.grad for name, p in (("conv", conv.weight), ("dense", dense.weight))}
        opt.step()
        report["avg"].append([p.grad.flatten().tolist() for p in opt.param_groups[0]["params"]])
        report["kept"].append(conv.weight.grad is before["conv"])
        report["shared"].append(dense.weight.grad.untyped_storage().data_ptr()
                                == dense.bias.grad.untyped_storage().data_ptr())
    (out / f"{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_gradients_after_the_step_are_the_averages_in_place_or_as_views(tmp_path: Path) -> None:
    run_world(_gradients_after_step, 2, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert r0["avg"] == r1["avg"]  # every rank holds the same averages
    # The average over ranks is the gradient of the average of both ranks' losses (steps 1
    # and 2 zeroed the previous views in place, then accumulated into them).
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
    dense = nn.Linear(4, 2)
    wide = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for step, got in enumerate(r0["avg"]):
        for p in (*conv.parameters(), *dense.parameters(), wide):
            p.grad = None
        x = [torch.full((1, 2, 5, 5), float(r + 1)).to(memory_format=torch.channels_last)
             for r in range(2)]
        for r in range(2):  # the average of both ranks' losses
            s = float(r + 1 + step)
            ((conv(x[r]).sum() * s + dense(torch.ones(1, 4)).sum() * s
              + (wide * s).sum()) / 2).backward()
        want = [p.grad.flatten().tolist() for p in (*conv.parameters(), *dense.parameters(),
                                                    wide)]
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(torch.tensor(g, dtype=torch.float64),
                                  torch.tensor(w, dtype=torch.float64)), step
    assert r0["kept"] == [True, True, True]  # channels_last: the same tensor, averaged in
    assert r0["shared"] == [True, True, True]  # contiguous: views of one averaged buffer
