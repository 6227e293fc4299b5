"""Train a digits classifier elastically: peers may come and go while it trains.

The dataset is scikit-learn's 8x8 digits, which ships inside the scikit-learn package
(nothing is downloaded). Run three peers on an embedded etcd:

    peer-elastic run --standalone -n 3 -- python examples/train_digits.py

Under ``peer-elastic run`` (stdout a pipe) each peer prints a progress line every few
seconds (``--progress-every``); on a terminal, rank 0 shows a progress bar instead.
Kill one (``kill -9``), stop one gracefully (``kill -TERM``), or start another with the same
``PEER_ELASTIC_ETCD`` / ``PEER_ELASTIC_JOB`` (``peer-elastic status`` shows them): training
goes on, and the test accuracy at the end is what it is without interruptions (about
0.96 after 12 epochs).

``--ddp`` averages the gradients with DistributedDataParallel instead of
``pe.DistributedOptimizer``: each generation has a new process group, so a reset callback
rebuilds the wrapper, and ``pe.allreduce_hook`` lets the reset vote ride on DDP's gradients,
so the ``check_host_updates()`` between commits runs no collective of its own.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
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


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        x, y = data.tensors
        return float((model(x).argmax(1) == y).float().mean())


class ProgressLines:
    """A plain line (epoch, step, rank/world, loss) at most every ``every_s`` seconds, the
    first at once: what shows progress where no bar can (stdout a pipe, as under
    ``peer-elastic run``, or a log file). Off with ``every_s`` 0."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._next = 0.0

    def maybe_print(self, epoch: int, step: int, rank: int, world: int, loss: float) -> None:
        now = time.monotonic()
        if self.every_s <= 0 or now < self._next:
            return
        self._next = now + self.every_s
        print(f"epoch {epoch} step {step} rank {rank}/{world} loss {loss:.4f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per peer")
    ap.add_argument("--lr", type=float, default=0.05, help="per peer; scaled by world size")
    ap.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    ap.add_argument("--target", type=float, default=0.0, help="exit 1 below this accuracy")
    ap.add_argument("--ddp", action="store_true",
                    help="average with DDP (rebuilt in a reset callback) and pe.allreduce_hook")
    ap.add_argument("--progress-every", type=float, default=2.0, metavar="SECONDS",
                    help="when stdout is not a terminal, print a progress line this often "
                    "(0: never)")
    args = ap.parse_args()
    progress = ProgressLines(0.0 if sys.stdout.isatty() else args.progress_every)

    train_set, test_set = load_digits_split()
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if not args.ddp:
        optimizer = pe.DistributedOptimizer(optimizer)
    sampler = pe.ElasticSampler(train_set, shuffle=True, seed=0)

    with pe.join() as peer:
        state = pe.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

        def rescale_lr() -> None:
            # Runs on every rank each time a group forms (the first one too), once state is
            # synced: keep lr proportional to the global batch size.
            for group in optimizer.param_groups:
                group["lr"] = args.lr * dist.get_world_size()

        # What the training loop calls: the model itself, or its DDP wrapper of this group.
        forward = {"model": model}

        def rebuild_ddp() -> None:
            ddp = nn.parallel.DistributedDataParallel(model)
            ddp.register_comm_hook(None, pe.allreduce_hook)
            forward["model"] = ddp

        state.register_reset_callbacks([rescale_lr, rebuild_ddp] if args.ddp else [rescale_lr])

        def train(state: pe.TorchState) -> float:
            loss_fn = nn.CrossEntropyLoss()
            while state.epoch < args.epochs:
                loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
                bar = None
                if peer.rank == 0 and sys.stderr.isatty():
                    from tqdm import tqdm

                    bar = tqdm(total=len(loader), desc=f"epoch {state.epoch} (world {peer.size})")
                for batch_idx, (x, y) in enumerate(loader):
                    optimizer.zero_grad()
                    loss = loss_fn(forward["model"](x), y)
                    loss.backward()
                    optimizer.step()
                    state.sampler.record_batch(batch_idx, args.batch_size)
                    if bar is not None:
                        bar.update(1)
                    progress.maybe_print(state.epoch, state.commit_count, peer.rank, peer.size,
                                         loss.item())
                    if (batch_idx + 1) % args.commit_every == 0:
                        state.commit()
                        peer.record_progress(epoch=state.epoch, batch=batch_idx,
                                             step=state.commit_count)
                    elif args.ddp:  # react to joins between commits: the vote rode on DDP's
                        state.check_host_updates()  # gradients, so this runs no collective
                if bar is not None:
                    bar.close()
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
            return accuracy(state.model, test_set)

        acc = peer.run(train, state)
        if peer.rank == 0:
            print(f"test accuracy {acc:.3f} after {args.epochs} epochs, "
                  f"{peer.resets} resets, final world size {peer.size}", flush=True)
    return 0 if acc >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
