"""State sync against a raw broadcast of the same bytes, side by side in one run.

(a) Two processes (gloo; ``--pair-world N`` for more), for models of about 0.4M, 50M and
    200M parameters with Adam after one step: ``TorchState.sync()`` from rank 0 into ranks
    holding other values, the whole reset-time path ``agree_and_sync`` (claims all-gather,
    sync, the receivers' restore points refreshed; rank 0's restore point already holds the
    agreed version, as after an interrupt at a commit), and a raw ``dist.broadcast`` of one
    tensor with as many bytes as the state's tensors. Beside them, the parts no protocol
    around the bytes removes: the state's tensors alone through ``broadcast_tensors`` (the
    sync's bucket pipeline, without check, header or description), its two copies
    alone, packing the buckets and unpacking them (each rank times both), and what sending
    without copies costs instead: one broadcast per tensor, straight into it, all in flight.
(b) A join into survivors: four processes, ranks 0-2 hold the same state (the survivors),
    rank 3 other values (the joiner). ``sync()`` striped over the three survivors (each sends
    a third of the bytes to the joiner), ``sync()`` as one broadcast from rank 0, and a raw
    ``dist.broadcast`` of the same bytes from rank 0.

Every repetition runs each variant once, in turn, in the same processes (the machine's
load hits all alike), and counts until the slowest rank is done; medians and minimums over
the repetitions. Each process uses one
thread. After the last repetition every rank's state digest must match rank 0's.

Usage::

    python benchmarks/bench_sync.py --out sync.json                    # default (~3-5 min)
    python benchmarks/bench_sync.py --sizes 0.4,50 --reps 5 --out s.json
    python benchmarks/bench_sync.py --quick --out sync_quick.json       # small, seconds
    python benchmarks/bench_sync.py --sizes 0.4 --join-size 0 --pair-world 4 --out w4.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from peer_elastic.state import TorchState
from peer_elastic.state.agreement import Claim, StateVersion
from peer_elastic.state.sync import agree_and_sync
from peer_elastic.torch.transport.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    DEFAULT_SPLIT_BYTES,
    halves,
    plan_buckets,
)
from peer_elastic.torch.transport.collectives import broadcast_tensors
from peer_elastic.torch.transport.snapshots import copy_all
from peer_elastic.torch.transport.sync_source import syncing_from

WORKER_TIMEOUT_S = 1800
# millions of parameters -> layer width (default 2048). 5M at width 128 is a deep model:
# 303 layers, 2424 state tensors with Adam's, as many as a ResNet-50's or a BERT's.
WIDTHS = {0.4: 256, 5.0: 128}


def build(params: int, width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of square Linear layers with about ``params`` parameters, and Adam after one
    step (exp_avg, exp_avg_sq and step for every parameter)."""
    torch.manual_seed(seed)
    layers = max(1, round(params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    return tensors + [v for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor)]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def interleaved(variants: dict[str, Callable[[], Any]], reps: int) -> dict[str, dict]:
    """Each repetition runs every variant once, in turn, each after a barrier. A
    repetition's time is the slowest rank's (a receiver's copies after the last byte count;
    one all-reduce at the end collects them)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([times[name] for name in variants], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: {"median": statistics.median(t), "min": min(t)}
            for name, t in zip(variants, slowest.tolist(), strict=True)}


def share(baseline: dict, measured: dict) -> dict:
    """``baseline`` time over ``measured`` time: 1.0 means as fast as the baseline."""
    return {k: baseline[k] / measured[k] for k in ("median", "min")}


def bench_pair(rank: int, millions: float, reps: int) -> dict[str, Any]:
    width = WIDTHS.get(millions, 2048)
    model, opt = build(int(millions * 1e6), width, seed=rank)  # rank 1 really receives
    state = TorchState(model, opt, epoch=rank)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    # Rank 0's restore point holds the agreed version (an interrupt at a commit, a restore
    # after a crash), so only rank 1 copies the synced state into its restore point.
    claim = Claim(StateVersion(1, 1, 1, 1), needs_state=rank != 0)
    committed = claim.version if rank == 0 else StateVersion()
    # The parts of a sync that no design around the bytes removes: its buckets' transfer
    # (packing and copies included), and the two copies alone, the source's into the
    # buckets and a receiver's out of them (each rank times both, as if it were either).
    packed = [half for bucket in plan_buckets(tensors, DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES)
              for half in halves(bucket, DEFAULT_SPLIT_BYTES) if len(half) > 1]
    received = [(_flatten_dense_tensors(b), [t.clone() for t in b]) for b in packed]
    times = interleaved({
        "raw_broadcast": lambda: dist.broadcast(raw, src=0),
        "sync": state.sync,
        "agree_and_sync": lambda: agree_and_sync(state, claim, torch.device("cpu"),
                                                 committed=committed),
        "tensors_only": lambda: broadcast_tensors(tensors, src=0),
        # No copies at all: one broadcast per tensor, straight into it, all in flight.
        "each_in_place": lambda: [work.wait() for work in
                                  [dist.broadcast(t, src=0, async_op=True) for t in tensors]],
        "pack": lambda: [_flatten_dense_tensors(b) for b in packed],
        "unpack": lambda: [copy_all(into, list(_unflatten_dense_tensors(wire, into)))
                           for wire, into in received],  # into copies: the state stays
    }, reps)
    out = {"millions": millions, "world": dist.get_world_size(),
           "params": sum(p.numel() for p in model.parameters()),
           "tensors": len(tensors), "bytes": nbytes, "digest": digest(state_tensors(model, opt)), **times,
           "sync_share": share(times["raw_broadcast"], times["sync"]),
           "agree_and_sync_share": share(times["raw_broadcast"], times["agree_and_sync"]),
           "tensors_only_share": share(times["raw_broadcast"], times["tensors_only"]),
           "packed_bytes": sum(t.nbytes for b in packed for t in b)}
    return out


def bench_join(rank: int, millions: float, reps: int, sources: int) -> dict[str, Any]:
    """Ranks below ``sources`` are survivors with one state; the others joiners."""
    model, opt = build(int(millions * 1e6), WIDTHS.get(millions, 2048),
                       seed=0 if rank < sources else rank)
    state = TorchState(model, opt, epoch=0 if rank < sources else rank)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    survivors = tuple(range(sources))

    def striped() -> None:
        with syncing_from(0, holders=survivors):
            state.sync()

    def broadcast() -> None:
        with syncing_from(0):
            state.sync()

    times = interleaved({
        "raw_broadcast": lambda: dist.broadcast(raw, src=0),
        "broadcast_sync": broadcast,
        "striped_sync": striped,
    }, reps)
    out = {"millions": millions, "world": dist.get_world_size(), "sources": sources,
           "bytes": nbytes, "digest": digest(state_tensors(model, opt)), **times,
           "striped_vs_raw": share(times["raw_broadcast"], times["striped_sync"]),
           "striped_vs_broadcast_sync": share(times["broadcast_sync"], times["striped_sync"])}
    return out


def worker(rank: int, world: int, port: int, job: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)  # the processes share the machine's cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        if job["kind"] == "pair":
            out = []
            for reps, millions in zip(job["reps"], job["sizes"], strict=True):
                out.append(bench_pair(rank, millions, reps))
                gc.collect()  # free this size's state before the next is built
        else:
            out = [bench_join(rank, job["millions"], job["reps"], job["sources"])]
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_world(world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``job`` in ``world`` processes; rank 0's results, checked against every rank's
    digests (all ranks must end bit-identical)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store.port, job, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        by_rank = dict(results.get(timeout=WORKER_TIMEOUT_S) for _ in range(world))
    finally:
        deadline = time.monotonic() + 60
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    for rank, out in by_rank.items():
        for mine, ref in zip(out, by_rank[0], strict=True):
            if mine["digest"] != ref["digest"]:
                raise SystemExit(f"rank {rank} differs from rank 0 after the sync")
    return by_rank[0]


def _ms(t: dict) -> str:
    return f"{t['median'] * 1e3:.1f} ms (min {t['min'] * 1e3:.1f})"


def _pct(r: dict) -> str:
    return f"{r['median'] * 100:.0f} % (min {r['min'] * 100:.0f} %)"


def print_table(res: dict[str, Any]) -> None:
    for r in res["pair"]:
        print(f"{r['params'] / 1e6:.1f}M params, {r['tensors']} tensors, "
              f"{r['bytes'] / 2**20:.1f} MiB, {r['world']} processes:")
        print(f"  raw broadcast   {_ms(r['raw_broadcast'])}")
        print(f"  sync()          {_ms(r['sync'])}  = {_pct(r['sync_share'])} of raw")
        print(f"  agree_and_sync  {_ms(r['agree_and_sync'])}  "
              f"= {_pct(r['agree_and_sync_share'])} of raw")
        print(f"  its tensors alone ({r['packed_bytes'] / 2**20:.1f} MiB packed): "
              f"{_ms(r['tensors_only'])}  = {_pct(r['tensors_only_share'])} of raw; "
              f"packing {_ms(r['pack'])}, unpacking {_ms(r['unpack'])}")
        print(f"  each tensor in place, its own broadcast: {_ms(r['each_in_place'])}")
    for r in res["join"]:
        print(f"join: {r['millions']:g}M params, {r['bytes'] / 2**20:.1f} MiB, world "
              f"{r['world']}, {r['sources']} survivors -> {r['world'] - r['sources']} joiner(s):")
        print(f"  raw broadcast from rank 0   {_ms(r['raw_broadcast'])}")
        print(f"  sync() as one broadcast     {_ms(r['broadcast_sync'])}")
        print(f"  sync() striped              {_ms(r['striped_sync'])}  = "
              f"{r['striped_vs_raw']['median']:.2f}x raw, "
              f"{r['striped_vs_broadcast_sync']['median']:.2f}x the broadcast sync")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--sizes", default="0.4,50,200",
                        help="model sizes for (a), millions of parameters (comma-separated)")
    parser.add_argument("--join-size", type=float, default=50.0,
                        help="model size for (b), millions of parameters (0: skip)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (x4 below 10M params)")
    parser.add_argument("--quick", action="store_true", help="small sizes, runs in seconds")
    parser.add_argument("--pair-world", type=int, default=2,
                        help="processes for (a): rank 0 sends, the others receive")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s] if not args.quick else [0.4, 4.0]
    join_size = 4.0 if args.quick else args.join_size
    reps = 3 if args.quick else args.reps

    started = time.perf_counter()
    res: dict[str, Any] = {"sizes": sizes, "join_size": join_size, "reps": reps,
                           "load_before": os.getloadavg()}
    res["pair"] = run_world(args.pair_world, {"kind": "pair", "sizes": sizes,
                                "reps": [reps * 4 if m < 10 else reps for m in sizes]})
    res["join"] = [] if not join_size else run_world(4, {
        "kind": "join", "millions": join_size, "reps": reps, "sources": 3})
    res["env"] = {"torch": torch.__version__, "python": platform.python_version(),
                  "cpus": os.cpu_count(), "machine": platform.machine(), "backend": "gloo",
                  "load_after": os.getloadavg(), "wall_s": time.perf_counter() - started}
    print_table(res)
    print(f"load average before {res['load_before'][0]:.1f}, after "
          f"{res['env']['load_after'][0]:.1f}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out} in {res['env']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
