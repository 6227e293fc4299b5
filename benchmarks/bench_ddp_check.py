"""``check_host_updates()`` after a DDP step: DDP's own reducer against ``pe.allreduce_hook``.

For each world size (default 2 and 4), ``world`` peers join one job in an etcd this script
starts on loopback (gloo, CPU, one thread per process), and inside ``peer.run`` train the
recovery benchmark's MLP (about 0.4M parameters; DDP cuts it into two buckets, the first of
about 1 MiB) with SGD. The variants of the same step:

* ``ddp``: DDP with its own reducer, no check (the baseline), and ``ddp_again``, the same
  step again (the A/A pair: the measurement's own noise);
* ``hook``: DDP with ``pe.allreduce_hook``, no check;
* ``hook_check``: the same, then ``peer.check_host_updates()``, which takes the vote the hook
  carried on DDP's first bucket and runs no collective;
* ``torch_hook``: DDP with torch's own Python ``allreduce_hook`` (what any Python hook costs
  against DDP's C++ reducer);
* ``ddp_check``: DDP's reducer, then a check. No step carried the vote, so the check
  exchanges its own bit (an async all-reduce, completed at the next check:
  ``peer_elastic.torch.check.pending_check``).

The first five alternate step by step, in an order shuffled every round (the same seed on
every rank), each against the same round's ``ddp`` step (the median of the ratios, with a
95 % bootstrap interval over rounds: ``bench_check.paired_overhead``). ``ddp_check`` leaves its
exchange in flight into the next step, so it runs in blocks against blocks of ``ddp``
(``block_ddp``), a barrier before each block. Reported per world: the median and p90 of the
check calls in both loops (issue 13's target: under 200 µs per call at world 4).

Usage::

    python benchmarks/bench_ddp_check.py --out ddp_check.json          # world 2 and 4
    python benchmarks/bench_ddp_check.py --worlds 2 --rounds 100       # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_check import paired_overhead, run_peers, stats_us  # noqa: E402

TARGET_US = 200.0
STEPWISE = ("ddp", "ddp_again", "hook", "hook_check", "torch_hook")
BLOCKWISE = ("block_ddp", "ddp_check")
BLOCKS = 8
WORKER_TIMEOUT_S = 600


def worker(rounds: int) -> int:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from recovery_worker import build_model, forward_backward
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import peer_elastic as pe

    model = build_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    with pe.join() as peer:
        state = pe.TorchState(model=model, optimizer=sgd, step=0)

        def measure(state: pe.TorchState) -> dict[str, Any]:
            rank = dist.get_rank()
            # Wrappers of one model: a reducer ignores the backward passes of another's
            # forward, so each step goes through exactly one of them.
            reducer = nn.parallel.DistributedDataParallel(model)
            hooked = nn.parallel.DistributedDataParallel(model)
            hooked.register_comm_hook(None, pe.allreduce_hook)
            torch_hooked = nn.parallel.DistributedDataParallel(model)
            torch_hooked.register_comm_hook(None, default_hooks.allreduce_hook)
            wrapper = {"ddp": reducer, "ddp_again": reducer, "block_ddp": reducer,
                       "ddp_check": reducer, "hook": hooked, "hook_check": hooked,
                       "torch_hook": torch_hooked}
            clock = time.perf_counter_ns
            steps: dict[str, list[int]] = {v: [] for v in (*STEPWISE, *BLOCKWISE)}
            checks: dict[str, list[int]] = {"ddp_check": [], "hook_check": []}
            step_no = 0

            def one(variant: str, timed: bool) -> None:
                nonlocal step_no
                t = clock()
                sgd.zero_grad(set_to_none=True)
                forward_backward(wrapper[variant], step_no, rank)
                sgd.step()
                step_no += 1
                if variant.endswith("_check"):
                    c = clock()
                    peer.check_host_updates()
                    if timed:
                        checks[variant].append(clock() - c)
                if timed:
                    steps[variant].append(clock() - t)

            for variant in (*STEPWISE, *BLOCKWISE):  # warm up: DDP cuts its buckets
                for _ in range(5):                    # after its first pass
                    one(variant, timed=False)
            order = random.Random(7)
            dist.barrier()
            for _ in range(rounds):
                names = list(STEPWISE)
                order.shuffle(names)
                for variant in names:
                    one(variant, timed=True)
            per_block = max(1, rounds // BLOCKS)
            for _ in range(BLOCKS):
                for variant in BLOCKWISE:
                    dist.barrier()
                    for _ in range(per_block):
                        one(variant, timed=True)
            return {"rank": rank, "world": dist.get_world_size(),
                    "check_exchanges": peer.stats.check_exchanges,
                    **{f"step_{k}_ns": v for k, v in steps.items()},
                    **{f"check_in_{k}_ns": v for k, v in checks.items()}}

        result = peer.run(measure, state)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_world(endpoint: str, world: int, rounds: int) -> dict[str, Any]:
    ranks = run_peers(Path(__file__).resolve(), endpoint, world,
                      f"ddp-check-{world}-{secrets.token_hex(3)}", ["--rounds", str(rounds)],
                      WORKER_TIMEOUT_S)
    res: dict[str, Any] = {"world": world, "rounds": rounds,
                           "check_exchanges": [r["check_exchanges"] for r in ranks]}
    for kind in ([f"step_{v}" for v in (*STEPWISE, *BLOCKWISE)]
                 + ["check_in_ddp_check", "check_in_hook_check"]):
        res[kind] = stats_us([v for r in ranks for v in r[f"{kind}_ns"]])
        res[kind]["worst_rank_median_us"] = max(
            statistics.median(r[f"{kind}_ns"]) / 1000 for r in ranks)
    for variant, base in [*((v, "ddp") for v in STEPWISE[1:]), ("ddp_check", "block_ddp")]:
        point, lo, hi = paired_overhead([r[f"step_{base}_ns"] for r in ranks],
                                        [r[f"step_{variant}_ns"] for r in ranks])
        res[f"{variant}_overhead_paired_median_pct"] = point
        res[f"{variant}_overhead_paired_ci95_pct"] = [lo, hi]
    res["hook_check_meets_target"] = res["check_in_hook_check"]["median_us"] < TARGET_US
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (2,4)")
    ap.add_argument("--rounds", type=int, default=600,
                    help="rounds of one step per variant (and as many steps of each in blocks)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.rounds)

    import torch

    from peer_elastic.etcd_server import EtcdServer

    results = []
    with EtcdServer() as server:
        for world in (int(w) for w in args.worlds.split(",") if w.strip()):
            results.append(run_world(server.endpoint, world, args.rounds))
    print("world | check after a DDP step: reducer (median / p90) | with pe.allreduce_hook "
          f"(median / p90) | < {TARGET_US:.0f} µs | step overhead vs DDP's reducer "
          "(paired median [95 % CI]): A/A | reducer + check (blocks) | torch's Python hook | "
          "pe hook | pe hook + check")
    for r in results:
        a, b = r["check_in_ddp_check"], r["check_in_hook_check"]

        def ovh(v: str, r: dict[str, Any] = r) -> str:
            lo, hi = r[f"{v}_overhead_paired_ci95_pct"]
            return f"{r[f'{v}_overhead_paired_median_pct']:+.2f} % [{lo:+.2f}, {hi:+.2f}]"

        print(f"{r['world']} | {a['median_us']:.1f} / {a['p90_us']:.1f} µs | "
              f"{b['median_us']:.1f} / {b['p90_us']:.1f} µs | "
              f"{'met' if r['hook_check_meets_target'] else 'MISSED'} | "
              f"{ovh('ddp_again')} | {ovh('ddp_check')} | {ovh('torch_hook')} | {ovh('hook')} | "
              f"{ovh('hook_check')} "
              f"(step: {r['step_ddp']['median_us'] / 1000:.2f} ms; exchanges per rank "
              f"{r['check_exchanges']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__,
                                              "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
