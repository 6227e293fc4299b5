"""Benchmark of the state layer against the naive ways, side by side in one run.

(a) ``TorchState.commit()`` vs ``deepcopy(model.state_dict()) + deepcopy(optimizer.state_dict())``
    for a ~50M-parameter model with Adam after one step (median of several repetitions).
(b) ``TorchState.sync()`` throughput vs a raw ``dist.broadcast`` of the same number of bytes
    (2 processes, gloo), for a peer that already has optimizer state and for a new peer.
(c) ``ElasticSampler.merge()`` (one all-reduce of a bitmap) and ``sync()`` vs the pickled-set
    union (``all_gather_object`` of Python sets, then union), for 1M and 10M samples, world 2.

Usage::

    python benchmarks/bench_state.py --out bench_state.json           # default (~1-2 min)
    python benchmarks/bench_state.py --quick --out bench_quick.json   # small, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import multiprocessing as mp
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

from peer_elastic.state import TorchState
from peer_elastic.state.sampler import ElasticSampler

WORLD = 2
WORKER_TIMEOUT_S = 600


def timed(fn: Callable[[], Any], reps: int, sync: Callable[[], None] | None = None) -> dict:
    """Median and minimum wall time of ``fn`` over ``reps`` runs (``sync`` runs before each,
    untimed). The median is the headline; the minimum shows the cost without the noise of
    other processes sharing the machine."""
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times)}


def ratio(slow: dict, fast: dict) -> dict:
    """How many times ``fast`` beats ``slow``, from medians and from minimums."""
    return {"median": slow["median"] / fast["median"], "min": slow["min"] / fast["min"]}


def build_model(params: int, width: int) -> nn.Module:
    """A stack of square Linear layers with about ``params`` parameters."""
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def trained_adam(model: nn.Module, width: int) -> torch.optim.Optimizer:
    """Adam after one step, so it has exp_avg / exp_avg_sq / step for every parameter."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


# --- (a) commit -----------------------------------------------------------------------------------


def bench_commit(params: int, width: int, reps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(params, width)
    opt = trained_adam(model, width)
    state = TorchState(model, opt, epoch=0, batch=0)

    def deepcopy_way() -> None:
        copy.deepcopy(model.state_dict())
        copy.deepcopy(opt.state_dict())

    commit = timed(state.commit, reps)
    deepcopy = timed(deepcopy_way, reps)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state_bytes(model, opt),
        "commit_s": commit,
        "deepcopy_s": deepcopy,
        "restore_s": timed(state.restore, reps),
        "speedup": ratio(deepcopy, commit),
    }


# --- (b) sync and (c) sampler merge: 2 processes ----------------------------------------------------


def bench_sync(rank: int, params: int, width: int, reps: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # different weights per rank: sync really has to move them
    model = build_model(params, width)
    opt = trained_adam(model, width)
    state = TorchState(model, opt, epoch=rank)
    nbytes = state_bytes(model, opt)
    raw = torch.zeros(nbytes, dtype=torch.uint8)

    sync = timed(state.sync, reps, sync=dist.barrier)
    raw_bcast = timed(lambda: dist.broadcast(raw, src=0), reps, sync=dist.barrier)

    # A newly joined peer: rank 1's optimizer has never stepped (empty state) each time.
    def fresh_joiner() -> None:
        if rank != 0:
            opt.state.clear()
        dist.barrier()

    joiner = timed(state.sync, reps, sync=fresh_joiner)

    # Its fair baseline: the receiver has to allocate (and page-fault) fresh memory too.
    def raw_into_fresh_buffer() -> None:
        buf = raw if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(buf, src=0)

    raw_fresh = timed(raw_into_fresh_buffer, reps, sync=dist.barrier)
    return {
        "bytes": nbytes,
        "sync_s": sync,
        "raw_broadcast_s": raw_bcast,
        "sync_GBps": nbytes / sync["median"] / 1e9,
        "raw_GBps": nbytes / raw_bcast["median"] / 1e9,
        "efficiency": ratio(raw_bcast, sync),
        "joiner_sync_s": joiner,
        "raw_fresh_broadcast_s": raw_fresh,
        "joiner_efficiency": ratio(raw_fresh, joiner),
    }


def bench_sampler(rank: int, n: int, reps: int) -> dict[str, Any]:
    """Half of the epoch processed, split between the ranks (rank r did i % 4 == r)."""
    sampler = ElasticSampler(range(n), record_all_ranks=False)
    mine = torch.arange(rank, n, 4)
    sampler.record_indices(mine)
    mine_set = set(mine.tolist())

    def set_union() -> None:
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, mine_set)
        union = set().union(*gathered)
        assert len(union) == n // 2

    merge = timed(sampler.merge, reps, sync=dist.barrier)
    sync = timed(sampler.sync, reps, sync=dist.barrier)
    union = timed(set_union, max(1, reps // 2), sync=dist.barrier)
    assert sampler.processed_count == n // 2
    return {
        "n": n,
        "merge_s": merge,
        "sampler_sync_s": sync,
        "pickled_set_union_s": union,
        "merge_speedup": ratio(union, merge),
        "sync_speedup": ratio(union, sync),
    }


def worker(rank: int, port: int, cfg: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)  # two processes share the two cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        out = {"sync": bench_sync(rank, cfg["params"], cfg["width"], cfg["reps"])}
        gc.collect()
        out["sampler"] = [bench_sampler(rank, n, cfg["reps"]) for n in cfg["sampler_sizes"]]
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def run_world(cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, store.port, cfg, results), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=WORKER_TIMEOUT_S)
    finally:
        deadline = time.monotonic() + 60
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return out


# --- report --------------------------------------------------------------------------------------------


def _ms(t: dict) -> str:
    return f"{t['median'] * 1e3:.1f} ms"


def _x(r: dict, fmt: str) -> str:
    return f"{fmt.format(r['median'])} (min {fmt.format(r['min'])})"


def print_table(res: dict[str, Any]) -> None:
    c, s = res["commit"], res["sync"]
    rows = [
        (
            "(a) commit() vs deepcopy",
            _ms(c["commit_s"]),
            _ms(c["deepcopy_s"]),
            _x(c["speedup"], "{:.1f}x"),
        ),
        ("    restore()", _ms(c["restore_s"]), "", ""),
        (
            "(b) sync() vs raw broadcast",
            f"{_ms(s['sync_s'])} ({s['sync_GBps']:.2f} GB/s)",
            f"{_ms(s['raw_broadcast_s'])} ({s['raw_GBps']:.2f} GB/s)",
            _x({k: v * 100 for k, v in s["efficiency"].items()}, "{:.0f}%"),
        ),
        (
            "    sync() to an empty joiner vs raw into fresh buffer",
            _ms(s["joiner_sync_s"]),
            _ms(s["raw_fresh_broadcast_s"]),
            _x({k: v * 100 for k, v in s["joiner_efficiency"].items()}, "{:.0f}%"),
        ),
    ]
    for m in res["sampler"]:
        label = f"{m['n'] / 1e6:g}M"
        rows.append(
            (
                f"(c) sampler merge, {label} vs pickled set union",
                _ms(m["merge_s"]),
                _ms(m["pickled_set_union_s"]),
                _x(m["merge_speedup"], "{:.0f}x"),
            )
        )
        rows.append(
            (
                f"    sampler sync (merge + re-partition), {label}",
                _ms(m["sampler_sync_s"]),
                "",
                _x(m["sync_speedup"], "{:.0f}x"),
            )
        )
    header = ("measurement (median)", "peer_elastic", "baseline", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(
        f"model: {c['params'] / 1e6:.1f}M params, state {c['state_bytes'] / 2**20:.0f} MiB "
        f"(model + Adam); sync moved {s['bytes'] / 2**20:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--quick", action="store_true", help="small sizes, runs in seconds")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    args = parser.parse_args(argv)

    if args.quick:
        cfg = {"params": 4_000_000, "width": 1024, "reps": 3, "sampler_sizes": [100_000, 1_000_000]}
    else:
        cfg = {
            "params": 50_000_000,
            "width": 2048,
            "reps": 7,
            "sampler_sizes": [1_000_000, 10_000_000],
        }
    if args.reps:
        cfg["reps"] = args.reps

    started = time.perf_counter()
    results: dict[str, Any] = {"config": cfg, "quick": args.quick}
    results["commit"] = bench_commit(cfg["params"], cfg["width"], cfg["reps"])
    gc.collect()  # free (a)'s model before the workers allocate theirs
    results.update(run_world(cfg))
    results["env"] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": torch.get_num_threads(),
        "machine": platform.machine(),
        "backend": "gloo",
        "world": WORLD,
        "wall_s": time.perf_counter() - started,
    }
    print_table(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out} in {results['env']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
