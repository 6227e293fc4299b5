"""Durable snapshots: what they cost the training step, how fast they write, how fast a job
resumes. One process, no etcd: the writer and the loader are the ones a peer uses
(peer_elastic.durable), driven directly.

The model is an MLP of about 50M float32 parameters trained with Adam, so one snapshot holds
about 600 MB (parameters and two moment buffers). Measured, in one run:

* **step overhead**: the same steps with an in-memory commit after every step, first
  without snapshots, then with one due every ``--interval`` seconds. Reported: the time the
  training thread spends in the writer's ``offer`` at a due commit (the staging copy),
  the mean step time of both runs, and what the measured extra time per snapshot costs at
  a 300 s interval (``extra per snapshot / 300 s``; the target is under 2%).
* **write throughput**: bytes over the writer thread's time per snapshot (DCP files, fsync,
  checksums, rename, manifest), while training and once with nothing else running, next to a plain ``torch.save`` of the same model and
  optimizer ``state_dict`` into the same directory (with an fsync: the same durability).
* **resume**: finding the newest snapshot, verifying its checksums and loading it into a
  fresh model and optimizer (what the loading rank does; the others then get it by the
  ordinary state sync, measured in docs/benchmarks-recovery.md).

    python benchmarks/bench_snapshot.py --dir /path/on/the/disk/to/measure [--out snapshot.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import peer_elastic as pe
from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.durable.resume import load_snapshot
from peer_elastic.durable.writer import SnapshotInfo, SnapshotWriter, Written


class Listener:
    def __init__(self) -> None:
        self.results: list[Written] = []
        self.errors: list[BaseException] = []

    def written(self, result: Written) -> None:
        self.results.append(result)

    def failed(self, error: BaseException) -> None:
        self.errors.append(error)

    def skipped(self) -> None:
        pass


def make_state(width: int, depth: int, seed: int) -> pe.TorchState:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return pe.TorchState(model=model, optimizer=opt, epoch=0, step=0)


def train(state: pe.TorchState, steps: int, batch: int, width: int,
          writer: SnapshotWriter | None) -> tuple[list[float], list[float]]:
    """Step times, and the time each due commit spent in offer()."""
    times, offers = [], []
    x = torch.randn(batch, width)
    for _ in range(steps):
        t0 = time.perf_counter()
        state.optimizer.zero_grad()
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()
        state.step += 1
        state.commit()  # in memory, every step: the cost peer-elastic users already pay
        if writer is not None and writer.due():
            t1 = time.perf_counter()
            if writer.offer(state, SnapshotInfo("bench", 1, 1)):
                offers.append(time.perf_counter() - t1)
        times.append(time.perf_counter() - t0)
    return times, offers


def torch_save_seconds(state: pe.TorchState, path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": state.model.state_dict(),
                    "optimizer": state.optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return took, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    ap.add_argument("--width", type=int, default=2896)  # 6 x (2896^2 + 2896) = 50.3M
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=float, default=5.0, help="snapshot interval measured")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--out", default=None, help="write the results here too (JSON)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-snap-"))
    state = make_state(args.width, args.depth, 0)
    params = sum(p.numel() for p in state.model.parameters())
    train(state, 3, args.batch, args.width, None)  # warm up (Adam state exists)

    base, _ = train(state, args.steps, args.batch, args.width, None)
    listener = Listener()
    directory = SnapshotDir(root, f"bench-{os.getpid()}")
    writer = SnapshotWriter(directory, every_s=args.interval, keep=2, listener=listener)
    with_snap, offers = train(state, args.steps, args.batch, args.width, writer)
    writer.wait_idle(600)
    n = len(listener.results)  # written while training
    # One more with nothing else running: the write itself, comparable with torch.save.
    assert writer.offer(state, SnapshotInfo("bench", 1, 1), force=True)
    writer.wait_idle(600)
    writer.close()
    assert not listener.errors, listener.errors
    idle = listener.results[-1]
    extra_total = sum(with_snap) - sum(base)
    per_snapshot = extra_total / n if n else float("nan")

    mb = idle.manifest.total_bytes / 2**20
    write_s = statistics.median(r.seconds for r in listener.results[:n])
    save_s, save_bytes = torch_save_seconds(state, root / "plain-torch-save.pt")

    fresh = make_state(args.width, args.depth, 1)
    t0 = time.perf_counter()
    newest = directory.newest_complete()
    assert newest is not None
    t1 = time.perf_counter()
    load_snapshot(fresh, directory, newest.id)
    t2 = time.perf_counter()
    same = all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                   state.model.state_dict().values(),
                                                   strict=True))

    out = {
        "params_m": round(params / 1e6, 1), "snapshot_mib": round(mb, 1),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "steps": args.steps, "interval_s": args.interval, "snapshots": n,
        "step_s_without": round(statistics.mean(base), 4),
        "step_s_with": round(statistics.mean(with_snap), 4),
        "offer_s_median": round(statistics.median(offers), 4) if offers else None,
        "extra_s_per_snapshot": round(per_snapshot, 3),
        "overhead_at_300s_pct": round(100 * per_snapshot / 300, 3),
        "overhead_at_300s_pct_from_offer": round(100 * statistics.median(offers) / 300, 3)
        if offers else None,
        "write_s_while_training": round(write_s, 3),
        "write_mib_s_while_training": round(mb / write_s, 1),
        "write_s_idle": round(idle.seconds, 3), "write_mib_s_idle": round(mb / idle.seconds, 1),
        "torch_save_s": round(save_s, 3),
        "torch_save_mib_s": round(save_bytes / 2**20 / save_s, 1),
        "resume_find_s": round(t1 - t0, 4), "resume_verify_and_load_s": round(t2 - t1, 3),
        "resumed_state_identical": same,
        "dir": str(root),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
