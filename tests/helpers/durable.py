"""Pieces of the durable-snapshot unit tests: a listener that records what the writer
thread reports, and a small training state to snapshot."""

from __future__ import annotations

import torch
from torch import nn

import peer_elastic as pe
from peer_elastic.durable.writer import Written


class Listener:
    """What the writer thread reports."""

    def __init__(self) -> None:
        self.results: list[Written] = []
        self.errors: list[BaseException] = []
        self.skips = 0

    def written(self, result: Written) -> None:
        self.results.append(result)

    def failed(self, error: BaseException) -> None:
        self.errors.append(error)

    def skipped(self) -> None:
        self.skips += 1


def make_state(seed: int = 0, n: int = 40) -> pe.TorchState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = pe.ElasticSampler(range(n), shuffle=True, seed=1, pad=False)
    return pe.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                         metric=torch.zeros(3), epoch=0, notes={"k": (1, b"x")})
