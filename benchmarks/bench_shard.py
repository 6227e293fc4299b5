"""Elastic sharded state: an in-memory reshard after a crash, and the cost of the redundancy,
side by side with the bytes alone, a local copy and a DCP checkpoint on disk, in one run.

Three processes on gloo (CPU, one thread each, no etcd) hold a :class:`ShardedState`: a stack
of square ``Linear`` layers (about ``--params`` million parameters), ``fully_shard`` per layer
and on the root, Adam after one step (so ``exp_avg`` and ``exp_avg_sq`` exist, sharded like
the parameters), ``redundancy=1``. The group forms with :func:`regroup` (fresh weights), trains
one step and saves, as at a commit. Then:

1. The redundancy at a commit, ``--reps`` rounds, the three variants in turn: ``state.save()``
   (this rank's shard kept, its copy sent to the rank ``copy_holders`` names, the copy of
   another rank's shard received); a local copy of the same shard (``torch._foreach_copy_``
   into preallocated buffers); a raw ``batch_isend_irecv`` of the bytes the copies carry.
2. A DCP checkpoint of the same state is written at world 3 (``torch.distributed.checkpoint``
   to a directory on local disk).
3. A crash: rank ``--crash-rank`` exits (``os._exit``). The two survivors destroy the process
   group and form a new one on a new store (old rank order kept), then, in turn:

   * ``--reps`` raw ``batch_isend_irecv`` of the bytes the reshard moves between ranks (from
     :func:`plan_moves`, the non-local moves, one message per pair), and of those bytes plus
     the copies of the new layout that the save at the end of ``regroup`` sends;
   * ``regroup(state, claim, cpu, generation=2)`` once: the claims' all-gather, the plan, the
     rows in flight, a fresh module on the new mesh filled from them, the save of the new
     layout. Its parts are timed by wrapping ``transfer``, ``ShardedState.rebuild`` and the
     final save;
   * ``--reps`` loads of the DCP checkpoint at world 2 into a fresh FSDP2 model and Adam
     (built once, not timed): ``get_state_dict``, ``dcp.load`` then ``set_state_dict``;
     each once with the checkpoint in the page cache (as just written) and once cold (its
     files' pages evicted first with ``posix_fadvise(POSIX_FADV_DONTNEED)``, so the bytes
     come from the disk).

   Before the crash, after ``regroup`` and after each DCP load, an exact checksum of every
   sharded tensor (its float bits weighted by global row) must match.

Every timing is the slowest rank's (a barrier before each variant, the maximum over ranks at
the end). ``--rounds`` fresh sets of processes repeat all of it (a crash happens once per
set); the report gives medians and minimums over every repetition.

Memory: each process samples its resident set (``/proc/self/statm``, every 2 ms) during the
first save after the training step (a commit) and during ``regroup``, and reports the peak
above what it held before its model was built. Child processes run with
``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``, 1 MiB by default) so that freed
tensors leave the resident set at once and the peak is what was live; 0 keeps glibc's own
setting (faster reuse of freed buffers, a resident set that overstates what is live). The
bound reported beside it: ``(2 + redundancy) x`` the rank's shard of parameters and
optimizer state, plus its largest message.

Usage::

    python benchmarks/bench_shard.py --out shard.json                 # 50M params (~3-5 min)
    python benchmarks/bench_shard.py --params 5 --rounds 1            # smaller, faster
    python benchmarks/bench_shard.py --params 0.005 --rounds 1 --reps 2   # smoke, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.sharded import ShardedState
from peer_elastic.sharded import regroup as regroup_mod
from peer_elastic.sharded.catalog import live_tensors
from peer_elastic.sharded.plan import (
    Layout,
    choose_restore,
    copy_holders,
    plan_moves,
    rows,
    senders_by_pair,
)
from peer_elastic.state.agreement import Claim, StateVersion

WORLD = 3
REDUNDANCY = 1
TIMEOUT = timedelta(seconds=600)
LR = 1e-3
BATCH = 8


def width_for(params: float) -> int:
    return min(2048, max(8, int(math.sqrt(params * 1e6 / 4))))


def layers_for(params: float, width: int) -> int:
    return max(1, round(params * 1e6 / (width * width + width)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- measuring ----------------------------------------------------------------------------------

class Resident:
    """The process's resident set, sampled every 2 ms by a thread while a phase runs (no
    thread otherwise: its wake-ups would slow the timed variants)."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    @classmethod
    def now(cls) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * cls.PAGE

    @classmethod
    @contextlib.contextmanager
    def phase(cls, out: dict[str, int]) -> Iterator[None]:
        out["before"] = peak = cls.now()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.002):
                peak = max(peak, cls.now())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            out["after"] = cls.now()
            out["peak"] = max(peak, out["after"])


def slowest(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each repetition's time of the slowest rank (collective)."""
    names = list(times)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist(), strict=True))


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checksum(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """Collective: per sharded tensor, the sum of its float bits weighted by global row
    (exact integer arithmetic, independent of how the rows are split), plus Adam's step."""
    sharded, replicated = live_tensors(model, optimizer)
    world, rank = dist.get_world_size(), dist.get_rank()
    sums = []
    for _, t in sharded:
        local = t.to_local().detach().contiguous()
        lo, hi = rows(t.shape[0], world, rank)
        bits = local.view(torch.int32).to(torch.int64).reshape(hi - lo, -1)
        weight = torch.arange(lo + 1, hi + 1, dtype=torch.int64).unsqueeze(1)
        sums.append(int((bits * weight).sum()) if hi > lo else 0)
    total = torch.tensor(sums, dtype=torch.int64)
    dist.all_reduce(total)
    steps = [int(v.item()) for _, v in replicated]
    return total.tolist() + steps


def raw_pairs(pair_bytes: dict[tuple[int, int], int]) -> Callable[[], None]:
    """A raw point-to-point exchange: one message of the given bytes per (sender, receiver)."""
    rank = dist.get_rank()
    bufs = [(s, r, torch.empty(n, dtype=torch.uint8)) for (s, r), n in sorted(pair_bytes.items())
            if rank in (s, r) and n > 0]

    def run() -> None:
        ops = [dist.P2POp(dist.isend if s == rank else dist.irecv, buf, r if s == rank else s)
               for s, r, buf in bufs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    return run


def copy_pair_bytes(layout: Layout, shard_bytes: dict[int, int]) -> dict[tuple[int, int], int]:
    """The bytes a save sends: each shard to its copy holders (FSDP: the owner sends)."""
    out: dict[tuple[int, int], int] = {}
    for shard, holders in copy_holders(layout, REDUNDANCY).items():
        for holder in holders:
            out[(shard, holder)] = out.get((shard, holder), 0) + shard_bytes[shard]
    return out


# -- the workload -------------------------------------------------------------------------------

def make_parts(params: float) -> tuple[Callable[[], nn.Module], Callable[..., Any],
                                       Callable[[nn.Module], torch.optim.Optimizer]]:
    width = width_for(params)
    depth = layers_for(params, width)

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        for layer in module:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module

    def optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(module.parameters(), lr=LR)

    return build, parallelize, optimizer


def train_step(state: ShardedState, width: int) -> None:
    model, opt = state.model, state.optimizer
    assert opt is not None
    torch.manual_seed(100 + dist.get_rank())
    model(torch.randn(BATCH, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def shard_bytes_of(state: ShardedState) -> int:
    sharded, _ = live_tensors(state.model, state.optimizer)
    return sum(t.to_local().numel() * t.element_size() for _, t in sharded)


def init_group(port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)


# -- one set of processes -----------------------------------------------------------------------

def worker(rank: int, args: argparse.Namespace, ports: tuple[int, int], ckpt: str,
           results: Any) -> None:
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mem = Resident
    out: dict[str, Any] = {"rank": rank}
    init_group(ports[0], rank, WORLD)
    cpu = torch.device("cpu")
    # The same code path once on a tiny model (imports, gloo's and FSDP's first allocations),
    # so that the memory baseline below holds everything but the state.
    warm = ShardedState(*make_parts(0.001), redundancy=REDUNDANCY)
    regroup_mod.regroup(warm, Claim(StateVersion(), False), cpu, 1)
    train_step(warm, width_for(0.001))
    warm.save()
    del warm
    gc.collect()
    dist.barrier()
    baseline = Resident.now()
    build, parallelize, make_opt = make_parts(args.params)
    width = width_for(args.params)
    state = ShardedState(build, parallelize, make_opt, redundancy=REDUNDANCY)
    agreement, _ = regroup_mod.regroup(state, Claim(StateVersion(), False), cpu, 1)
    lineage = agreement.version.lineage
    train_step(state, width)
    commits = 0

    def version() -> StateVersion:
        return StateVersion(lineage, commits, 1, commits)

    # 1. a commit's save, its memory; then save vs a local copy vs the raw bytes, in turn.
    commits += 1
    state.expect_save(version())
    commit_mem: dict[str, int] = {}
    with mem.phase(commit_mem):
        state.save()
    shard_b = shard_bytes_of(state)
    all_shards = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(all_shards, torch.tensor([shard_b], dtype=torch.int64))
    shard_sizes = {s: int(t.item()) for s, t in enumerate(all_shards)}
    layout = state.layout
    assert layout is not None
    copies = copy_pair_bytes(layout, shard_sizes)
    sharded, _ = live_tensors(state.model, state.optimizer)
    locals_ = [t.to_local() for _, t in sharded]
    bufs = [torch.empty_like(t) for t in locals_]
    del sharded

    def save() -> None:
        nonlocal commits
        commits += 1
        state.expect_save(version())
        state.save()

    variants: dict[str, Callable[[], None]] = {
        "save": save,
        "local_copy": lambda: torch._foreach_copy_(bufs, locals_),
        "raw_copies": raw_pairs(copies),
    }
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    out["commit"] = slowest(times)
    del fn  # the last variant: its receive buffer would stay resident
    variants.clear()
    bufs.clear()
    locals_.clear()
    out["memory_commit"] = {k: v - baseline for k, v in commit_mem.items()}
    out["shard_bytes_w3"] = shard_b
    out["copy_bytes_w3"] = sum(n for (s, r), n in copies.items() if s == rank)
    held = [("after the commits", Resident.now() - baseline)]
    before = checksum(state.model, state.optimizer)
    saved_version = version()

    # 2. a DCP checkpoint of the same state at world 3.
    start = time.perf_counter()
    msd, osd = get_state_dict(state.model, state.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    del msd, osd
    out["dcp_save_s"] = time.perf_counter() - start
    held.append(("after the DCP save", Resident.now() - baseline))
    dist.barrier()

    # 3. the crash; the survivors form a new group on a new store.
    if rank == args.crash_rank:
        os._exit(0)
    dist.destroy_process_group()
    new_rank = rank - (rank > args.crash_rank)
    init_group(ports[1], new_rank, WORLD - 1)
    dist.barrier()

    holdings: list[Any] = [None] * (WORLD - 1)
    dist.all_gather_object(holdings, (state.holdings(), state.values_version))
    point = choose_restore([h for h, _ in holdings], [v for _, v in holdings])
    assert point is not None
    saved = state.saved(point.version, point.layout)
    assert saved is not None
    catalog = saved.catalog
    new_layout = Layout(2, WORLD - 1, WORLD - 1)
    row_bytes = [math.prod(e.row_shape) * e.torch_dtype.itemsize for e in catalog.sharded]
    moves = senders_by_pair(plan_moves([e.rows for e in catalog.sharded], point, new_layout))
    move_bytes = {pair: sum(m.count * row_bytes[m.tensor] for m in ms)
                  for pair, ms in moves.items()}
    new_shards = {}
    for s in range(new_layout.shards):
        new_shards[s] = sum((rows(e.rows, new_layout.shards, s)[1]
                             - rows(e.rows, new_layout.shards, s)[0]) * row_bytes[i]
                            for i, e in enumerate(catalog.sharded))
    new_copies = copy_pair_bytes(new_layout, new_shards)
    out["moved_bytes"] = sum(move_bytes.values())
    out["moved_bytes_by_pair"] = {f"{s}->{r}": n for (s, r), n in move_bytes.items()}
    out["new_copy_bytes"] = sum(new_copies.values())
    out["shard_bytes_w2"] = new_shards[new_rank]
    out["largest_message_in"] = max([n for (s, r), n in move_bytes.items() if r == new_rank]
                                    + [n for (s, r), n in new_copies.items() if r == new_rank]
                                    + [0])
    fns = {"moves": raw_pairs(move_bytes), "copies": raw_pairs(new_copies)}

    def raw_both() -> None:
        fns["moves"]()
        fns["copies"]()

    raw: dict[str, list[float]] = {"raw_moves": [], "raw_moves_and_copies": []}
    for _ in range(args.reps):
        raw["raw_moves"].append(timed(fns["moves"]))
        raw["raw_moves_and_copies"].append(timed(raw_both))
    fns.clear()  # their buffers
    held.append(("after the raw transfers", Resident.now() - baseline))

    # regroup, its parts timed by wrapping what it calls.
    parts: dict[str, float] = {"transfer": 0.0, "rebuild": 0.0, "finish": 0.0}

    marks: list[tuple[str, int]] = []  # the resident set as each part starts and ends

    def timing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            marks.append((f"{name} starts", Resident.now() - baseline))
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += time.perf_counter() - start
                marks.append((f"{name} ends", Resident.now() - baseline))
        return wrapped

    originals = (regroup_mod.transfer, ShardedState.rebuild, regroup_mod._finish)
    regroup_mod.transfer = timing("transfer", regroup_mod.transfer)  # type: ignore[assignment]
    ShardedState.rebuild = timing("rebuild", ShardedState.rebuild)  # type: ignore[method-assign]
    regroup_mod._finish = timing("finish", regroup_mod._finish)  # type: ignore[assignment]
    reshard_mem: dict[str, int] = {}
    dist.barrier()
    try:
        with mem.phase(reshard_mem):
            start = time.perf_counter()
            regroup_mod.regroup(state, Claim(saved_version, False), cpu, 2)
            regroup_s = time.perf_counter() - start
    finally:
        regroup_mod.transfer, ShardedState.rebuild, regroup_mod._finish = originals  # type: ignore[assignment,method-assign]
    after = checksum(state.model, state.optimizer)
    reg = slowest({"regroup": [regroup_s], **{k: [v] for k, v in parts.items()}})
    out["regroup"] = {k: v[0] for k, v in reg.items()}
    out["raw"] = slowest(raw)
    out["memory_reshard"] = {k: v - baseline for k, v in reshard_mem.items()}
    out["memory_reshard_marks"] = held + marks
    out["checksum_match"] = before == after

    # the same state from the DCP checkpoint at world 2: a fresh FSDP2 model and Adam.
    mesh = init_device_mesh("cpu", (WORLD - 1,))
    with torch.device("meta"):
        fresh = build()
    parallelize(fresh, mesh)
    fresh.to_empty(device=cpu)
    fresh_opt = make_opt(fresh)

    def load() -> None:
        msd, osd = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)

    def evict() -> None:
        # Only this checkpoint's pages leave the page cache (written and synced by DCP).
        for name in os.listdir(ckpt):
            fd = os.open(os.path.join(ckpt, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    loads: dict[str, list[float]] = {"dcp_load": [], "dcp_load_cold": []}
    for _ in range(args.reps):
        loads["dcp_load"].append(timed(load))
        evict()
        loads["dcp_load_cold"].append(timed(load))
    out.update(slowest(loads))
    out["dcp_checksum_match"] = checksum(fresh, fresh_opt) == before
    mine = {k: out[k] for k in ("memory_commit", "memory_reshard", "memory_reshard_marks",
                                "shard_bytes_w3", "shard_bytes_w2", "largest_message_in",
                                "copy_bytes_w3")}
    peers: list[Any] = [None] * (WORLD - 1)
    dist.all_gather_object(peers, mine)
    out["memory_by_rank"] = peers
    if new_rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------

def one_round(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ckpt = tempfile.mkdtemp(prefix="bench_shard_dcp_", dir=args.dir)
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=worker, args=(r, args, ports, ckpt, results))
             for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        out = None
        while out is None:
            try:
                out = results.get(timeout=1)
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError("a round ran past --timeout") from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a worker failed: "
                                       f"{[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"worker exit codes {[p.exitcode for p in procs]}")
        out["dcp_bytes"] = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(ckpt, ignore_errors=True)


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values)}


def summarize(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def every(pick: Callable[[dict[str, Any]], list[float]]) -> dict[str, float]:
        return stats([v for r in rounds for v in pick(r)])

    width = width_for(args.params)
    depth = layers_for(args.params, width)
    first = rounds[0]
    save = every(lambda r: r["commit"]["save"])
    local = every(lambda r: r["commit"]["local_copy"])
    regroup = every(lambda r: [r["regroup"]["regroup"]])
    raw_moves = every(lambda r: r["raw"]["raw_moves"])
    raw_all = every(lambda r: r["raw"]["raw_moves_and_copies"])
    dcp_load = every(lambda r: r["dcp_load"])
    dcp_cold = every(lambda r: r["dcp_load_cold"])
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "workload": {"params": depth * (width * width + width), "layers": depth, "width": width,
                     "state_bytes": 3 * depth * (width * width + width) * 4,
                     "world": f"{WORLD} -> {WORLD - 1}", "redundancy": REDUNDANCY,
                     "rounds": len(rounds), "reps": args.reps,
                     "malloc_mmap_threshold": args.malloc_mmap_threshold},
        "commit": {"save": save, "local_copy": local,
                   "raw_copies": every(lambda r: r["commit"]["raw_copies"]),
                   "save_over_local_copy": save["median"] / local["median"]},
        "crash": {"moved_bytes": first["moved_bytes"],
                  "moved_bytes_by_pair": first["moved_bytes_by_pair"],
                  "new_copy_bytes": first["new_copy_bytes"],
                  "raw_moves": raw_moves, "raw_moves_and_copies": raw_all,
                  "regroup": regroup,
                  "regroup_parts": {k: every(lambda r, k=k: [r["regroup"][k]])
                                    for k in ("transfer", "rebuild", "finish")},
                  "regroup_over_raw_moves": regroup["median"] / raw_moves["median"],
                  "regroup_over_raw_moves_and_copies": regroup["median"] / raw_all["median"],
                  "dcp_load": dcp_load, "dcp_save_w3": every(lambda r: [r["dcp_save_s"]]),
                  "dcp_bytes": first["dcp_bytes"],
                  "dcp_load_cold": dcp_cold,
                  "dcp_load_over_regroup": dcp_load["median"] / regroup["median"],
                  "dcp_load_cold_over_regroup": dcp_cold["median"] / regroup["median"],
                  "checksums_match": all(r["checksum_match"] for r in rounds),
                  "dcp_checksums_match": all(r["dcp_checksum_match"] for r in rounds)},
        "memory": [{
            "rank": f"{old} -> {new}",
            "shard_bytes_w3": m["shard_bytes_w3"], "shard_bytes_w2": m["shard_bytes_w2"],
            "commit_peak": max(r["memory_by_rank"][new]["memory_commit"]["peak"]
                               for r in rounds),
            "commit_held": max(r["memory_by_rank"][new]["memory_commit"]["after"]
                               for r in rounds),
            "commit_bound": (2 + REDUNDANCY) * m["shard_bytes_w3"] + m["copy_bytes_w3"],
            "reshard_peak": max(r["memory_by_rank"][new]["memory_reshard"]["peak"]
                                for r in rounds),
            "reshard_held_before": max(r["memory_by_rank"][new]["memory_reshard"]["before"]
                                       for r in rounds),
            "reshard_held_after": max(r["memory_by_rank"][new]["memory_reshard"]["after"]
                                      for r in rounds),
            "reshard_bound": (2 + REDUNDANCY) * max(m["shard_bytes_w2"], m["shard_bytes_w3"])
            + m["largest_message_in"],
            "reshard_marks": m["memory_reshard_marks"],
        } for new, (old, m) in enumerate(zip(
            [r for r in range(WORLD) if r != args.crash_rank], first["memory_by_rank"],
            strict=True))],
        "full_state_bytes": 3 * depth * (width * width + width) * 4,
        "memory_note": "each survivor's resident set above what it held before building its "
                       "model (the maximum over rounds)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50.0, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=2, help="fresh process sets (crashes)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per variant and round")
    parser.add_argument("--crash-rank", type=int, default=1, choices=range(WORLD))
    parser.add_argument("--dir", default=None, help="where the DCP checkpoint goes (local disk)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                        help="MALLOC_MMAP_THRESHOLD_ of the workers (0: glibc's default)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per round")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    if args.malloc_mmap_threshold > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    rounds = []
    for i in range(args.rounds):
        start = time.monotonic()
        rounds.append(one_round(args))
        print(f"round {i + 1}/{args.rounds}: {time.monotonic() - start:.1f} s", flush=True)
    report = summarize(rounds, args)
    report["rounds"] = rounds
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: v for k, v in report.items() if k != "rounds"}
    print(json.dumps(summary, indent=2))
    ok = report["crash"]["checksums_match"] and report["crash"]["dcp_checksums_match"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
