"""DistributedOptimizer: gradients averaged over the current group, on real processes."""

from __future__ import annotations

import json
from pathlib import Path

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
