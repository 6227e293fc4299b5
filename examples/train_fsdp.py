"""Train a digits classifier sharded with FSDP2, elastically: peers may crash, leave or join.

No peer holds the whole model or optimizer: each holds its shard of every layer and of Adam's
state, plus a copy of another peer's shard. When a peer dies, the others rebuild the model on
the new group and move only the rows that changed owner, from memory (no checkpoint is read).
Run three peers on an embedded etcd:

    peer-elastic run --standalone -n 3 -- python examples/train_fsdp.py

Kill one (``kill -9``), stop one gracefully (``kill -TERM``), or start another with the same
``PEER_ELASTIC_ETCD`` / ``PEER_ELASTIC_JOB``: training goes on from the last commit, and the
test accuracy at the end is what it is without interruptions (about 0.97).

``--hsdp S`` shards over groups of S peers and replicates across the groups (HSDP).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import peer_elastic as pe


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = perm[:360], perm[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    def __init__(self, width: int = 256, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def parallelize(model: Net, mesh: object) -> Net:
    """Shard each block, then the rest: called by peer-elastic for every group's mesh."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per peer")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    ap.add_argument("--hsdp", type=int, default=None, metavar="S",
                    help="HSDP: shard over groups of S peers, replicate across them")
    ap.add_argument("--target", type=float, default=0.0, help="exit 1 below this accuracy")
    args = ap.parse_args()

    train_set, test_set = load_digits_split()
    state = pe.ShardedState(
        model=Net, parallelize=parallelize,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=args.lr),
        shard_degree=args.hsdp,
        sampler=pe.ElasticSampler(train_set, shuffle=True, seed=0), epoch=0)

    with pe.join() as peer:

        def train(state: pe.ShardedState) -> float:
            # This generation's sharded model and optimizer (rebuilt after every change).
            model, optimizer = state.model, state.optimizer
            loss_fn = nn.CrossEntropyLoss()
            while state.epoch < args.epochs:
                loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
                for batch_idx, (x, y) in enumerate(loader):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()  # FSDP averages gradients over the peers
                    optimizer.step()
                    state.sampler.record_batch(batch_idx, args.batch_size)
                    if (batch_idx + 1) % args.commit_every == 0:
                        state.commit()
                        peer.record_progress(epoch=state.epoch, batch=batch_idx,
                                             step=state.commit_count)
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
            with torch.no_grad():  # every peer runs the (collective) forward pass
                x, y = test_set.tensors
                return float((model(x).argmax(1) == y).float().mean())

        acc = peer.run(train, state)
        if peer.rank == 0:
            print(f"test accuracy {acc:.3f} after {args.epochs} epochs, "
                  f"{peer.resets} resets, final world size {peer.size}", flush=True)
    return 0 if acc >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
