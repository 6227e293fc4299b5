"""One peer of a real elastic training job with an exactly-once oracle.

The model's ``counts`` parameter gains exactly 1.0 for every sample trained on: each rank's
loss is ``-world * counts[batch].sum()``, gradients are averaged over the world, and SGD
with lr 1 adds the count of every sample of every rank (exact in float64). After the job,
every sample of every epoch must have been counted exactly once: ``counts == EPOCHS``.
A small network trained with Adam on the side proves optimizer state stays bit-identical.

Settings come from PEER_ELASTIC_* like any peer; the test knobs are WORKER_* variables.
Prints (flushed) ``HANGING <pid>`` and ``SLOW <epoch> <batch> <s>`` at the stalls the
WORKER_HANG_AT / WORKER_SLOW_AT knobs ask for, ``GEN <generation> <rank> <size>`` after each (re)formation,
``STEP <epoch> <batch> <generation>`` every few batches, and on rank 0 at the end
``RESULT <json>``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import peer_elastic as pe

N = int(os.environ.get("WORKER_SAMPLES", "480"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "2"))
BS = int(os.environ.get("WORKER_BATCH", "4"))
STEP_S = float(os.environ.get("WORKER_STEP_S", "0.02"))
COMMIT_EVERY = int(os.environ.get("WORKER_COMMIT_EVERY", "2"))
RESULT_PATH = os.environ.get("WORKER_RESULT")
# WORKER_DDP=1: average gradients with DistributedDataParallel, rebuilt in a reset callback
# (the README's recipe), instead of pe.DistributedOptimizer.
USE_DDP = os.environ.get("WORKER_DDP") == "1"
# WORKER_HANG_AT=<epoch>:<batch>[:<rank>]: the training thread blocks for good at the start
# of that batch (on that rank only, if given) while the process and its other threads live;
# with WORKER_HANG_FLAG=<path> only the first process to get there (it creates the file).
# WORKER_SLOW_AT=<epoch>:<batch>:<seconds>[:<rank>]: that batch takes that much longer.
HANG_AT = os.environ.get("WORKER_HANG_AT")
HANG_FLAG = os.environ.get("WORKER_HANG_FLAG")
SLOW_AT = os.environ.get("WORKER_SLOW_AT")


def _at(spec: str | None, epoch: int, batch: int, rank: int, fields: int) -> list[str] | None:
    """The extra fields of ``spec`` ("epoch:batch:<fields>[:rank]") if it names this batch."""
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != epoch or int(parts[1]) != batch:
        return None
    extra = parts[2:2 + fields]
    if len(parts) > 2 + fields and int(parts[2 + fields]) != rank:
        return None
    return extra


def hang_forever() -> None:
    """A training thread stuck for good (a data loader that never yields, say)."""
    say("HANGING", os.getpid())
    threading.Event().wait()


def maybe_stall(epoch: int, batch: int, rank: int) -> None:
    if _at(HANG_AT, epoch, batch, rank, 0) is not None:
        if HANG_FLAG:
            try:
                os.close(os.open(HANG_FLAG, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # another process hung already
        hang_forever()
    slow = _at(SLOW_AT, epoch, batch, rank, 1)
    if slow is not None:
        say("SLOW", epoch, batch, slow[0])
        time.sleep(float(slow[0]))  # a long step (evaluation, a slow batch)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(N, dtype=torch.float64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.counts[idx]


class Both(nn.Module):
    """The two models behind one forward, so DDP sees every parameter used."""

    def __init__(self, counter: Counter, net: nn.Module) -> None:
        super().__init__()
        self.counter, self.net = counter, net

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counter(idx), self.net(x)


def digest(state: pe.TorchState) -> str:
    h = hashlib.sha256()
    for t in [*state.model.state_dict().values(), *state.net.state_dict().values()]:
        h.update(t.detach().contiguous().numpy().tobytes())
    for opt in (state.optimizer, state.adam):
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def say(*parts: object) -> None:
    print(*parts, flush=True)


def main() -> int:
    torch.manual_seed(os.getpid())  # different initial weights: sync must fix that
    with pe.join() as peer:
        sampler = pe.ElasticSampler(range(N), shuffle=True, seed=1, pad=False)
        counter = Counter()
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        sgd = torch.optim.SGD(counter.parameters(), lr=1.0)
        adam = torch.optim.Adam(net.parameters(), lr=1e-2)
        if not USE_DDP:
            sgd, adam = pe.DistributedOptimizer(sgd), pe.DistributedOptimizer(adam)
        state = pe.TorchState(model=counter, optimizer=sgd, net=net, adam=adam, sampler=sampler,
                              epoch=0)
        seen_sizes: list[int] = []
        holder: dict[str, nn.Module] = {}

        def rebuild_ddp() -> None:
            # Each generation has a new process group: DDP must be rebuilt on it.
            holder["ddp"] = nn.parallel.DistributedDataParallel(Both(counter, net))

        callbacks = [lambda: seen_sizes.append(dist.get_world_size())]
        if USE_DDP:
            callbacks.append(rebuild_ddp)
        state.register_reset_callbacks(callbacks)

        def train(state: pe.TorchState) -> dict:
            world = dist.get_world_size()
            say("GEN", peer.generation, peer.rank, world)
            while state.epoch < EPOCHS:
                shard = list(iter(state.sampler))
                nb = torch.tensor([math.ceil(len(shard) / BS)])
                dist.all_reduce(nb, op=dist.ReduceOp.MAX)  # lockstep: short ranks step empty
                for b in range(int(nb)):
                    maybe_stall(state.epoch, b, peer.rank)
                    idx = torch.tensor(shard[b * BS:(b + 1) * BS], dtype=torch.int64)
                    state.optimizer.zero_grad()
                    state.adam.zero_grad()
                    x = torch.sin(idx.to(torch.float32)[:, None] * torch.arange(1, 9))
                    if USE_DDP:
                        counts, y = holder["ddp"](idx, x)
                    else:
                        counts, y = state.model(idx), state.net(x)
                    loss = -(world * counts).sum()
                    loss2 = ((y - 0.5) ** 2).sum() * (len(idx) > 0)
                    (loss + loss2).backward()
                    state.optimizer.step()
                    state.adam.step()
                    state.sampler.record_batch(b, BS)
                    time.sleep(STEP_S)
                    if b % 5 == 0:
                        say("STEP", state.epoch, b, peer.generation)
                    if (b + 1) % COMMIT_EVERY == 0:
                        state.commit()
                        peer.record_progress(epoch=state.epoch, batch=b, step=state.commit_count)
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, digest(state))  # test-only: trusted peers
            counts = state.model.counts.detach()
            return {
                "exact": bool(torch.equal(counts, torch.full_like(counts, float(EPOCHS)))),
                "min": float(counts.min()), "max": float(counts.max()),
                "identical": len(set(digests)) == 1, "world": dist.get_world_size(),
                "generation": peer.generation, "rank": peer.rank, "resets": peer.resets,
                "reset_sizes": seen_sizes,  # one per formed group, the first included
            }

        result = peer.run(train, state)
        if peer.rank == 0:
            say("RESULT", json.dumps(result))
            if RESULT_PATH:
                with open(RESULT_PATH, "w") as f:
                    json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
