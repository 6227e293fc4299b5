"""Stragglers: what measuring them costs, and what the job's throughput is with one.

Two parts, each in real ``pe.join()`` jobs on an etcd this script starts on loopback (gloo,
CPU, one thread per peer):

``cost``: the price of measuring. ``world`` peers train the recovery benchmark's MLP (about
0.4 M parameters, ``DistributedOptimizer`` with SGD and momentum) with a
``check_host_updates()`` after every step. Rounds of two blocks of ``--steps`` steps, one
with the straggler watch on (``peer.straggler.enabled``: each check clocks its interval,
about once a second the group exchanges its paces in one all-reduce, completed at the next
exchange) and one with
it off, in an order that alternates by round (the same on every rank). Reported: the check's
mean and median time with and without, and the step's overhead, paired by round (the
median over rounds and ranks of the step with measuring against the same round's step
without), with a 95 % bootstrap interval, in wall time and in the CPU time of the process
(all its threads; without the waits on other ranks, which load the wall time with the
noise of a busy machine). And, in this process right after a training
step (the caches cold, as in a loop), what counting a check and timing an all-reduce cost.

``throughput``: samples per second of a job whose peers each train a small model plus
``--step-s`` of simulated device time per step (a sleep: each peer has a device of its
own, so a stopped peer frees no device for the others, as on GPUs), side by side:

* ``healthy-4``: four peers at full speed;
* ``throttled-4-report``: four, one of them (rank 3) stopped two thirds of the time
  (SIGSTOP/SIGCONT from this script: tests/helpers/throttle.py), ``straggler_policy=report``;
* ``throttled-4-evict``: the same under ``straggler_policy=evict``: measured after the
  straggler left;
* ``healthy-3``: three peers at full speed.

Each is measured over ``--measure`` seconds of steady state (after ``--warmup`` s, and a
few seconds after the throttle started or the eviction took effect). Also reported: when
the ``straggler`` event came after the throttle began (the detection), and when the
eviction took effect. Targets: under ``evict``, steady-state throughput at least 90 % of
``healthy-3``; detection within the window (plus the exchanges it takes to see it).

Usage::

    python benchmarks/bench_straggler.py --out straggler.json        # both parts (~8 min)
    python benchmarks/bench_straggler.py --parts cost --worlds 2,4   # the cost alone
    python benchmarks/bench_straggler.py --parts throughput --measure 20 --window 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

EVICT_TARGET = 0.9
#: Detection within the window plus this many exchanges of paces: the first measurement
#: that is all slow ends up to two exchanges after the slowdown began, the verdict comes at
#: the first exchange a window later, and the event is written after it.
DETECTION_SLACK_EXCHANGES = 4
BOOTSTRAP_SAMPLES = 1000


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


# --- workers ------------------------------------------------------------------------------------


def cost_worker(rounds: int, steps: int) -> int:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from recovery_worker import build_model, forward_backward, warm_up

    import peer_elastic as pe

    model = build_model()
    warm_up(model)
    optimizer = pe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                        momentum=0.9))
    clock = time.perf_counter_ns
    with pe.join() as peer:
        state = pe.TorchState(model=model, optimizer=optimizer, step=0)

        def measure(state: pe.TorchState) -> dict[str, Any]:
            rank = dist.get_rank()
            checks: dict[bool, list[int]] = {True: [], False: []}
            blocks: dict[bool, list[float]] = {True: [], False: []}
            cpu: dict[bool, list[float]] = {True: [], False: []}

            def step(i: int) -> int:
                state.optimizer.zero_grad(set_to_none=True)
                forward_backward(state.model, i, rank)
                state.optimizer.step()
                t = clock()
                peer.check_host_updates()
                return clock() - t

            for i in range(50):  # warm up, measuring on
                step(i)
            for r in range(rounds):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    peer.straggler.enabled = on  # at the same check on every rank
                    began, began_cpu = clock(), time.process_time_ns()
                    for i in range(steps):
                        checks[on].append(step(i))
                    blocks[on].append((clock() - began) / steps)
                    cpu[on].append((time.process_time_ns() - began_cpu) / steps)
            peer.straggler.enabled = True
            return {"rank": rank, "check_on_ns": checks[True], "check_off_ns": checks[False],
                    "step_on_ns": blocks[True], "step_off_ns": blocks[False],
                    "cpu_on_ns": cpu[True], "cpu_off_ns": cpu[False]}

        result = peer.run(measure, state)
    say("RESULT", json.dumps(result))
    return 0


def train_worker(step_s: float, commit_every: int) -> int:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from recovery_worker import BATCH, build_model, forward_backward, warm_up

    import peer_elastic as pe

    model = build_model()
    warm_up(model)
    optimizer = pe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    with pe.join() as peer:
        state = pe.TorchState(model=model, optimizer=optimizer, step=0, samples=0)

        def train(state: pe.TorchState) -> int:
            rank, world = dist.get_rank(), dist.get_world_size()
            say("GEN", f"{time.time():.6f}", peer.generation, rank, world, os.getpid())
            while True:
                state.optimizer.zero_grad(set_to_none=True)
                forward_backward(state.model, state.step, rank)
                time.sleep(step_s)  # the device's share of the step
                state.optimizer.step()
                state.step += 1
                state.samples += world * BATCH
                if rank == 0:
                    say("STEP", f"{time.time():.6f}", peer.generation, world, state.samples)
                if state.step % commit_every == 0:
                    state.commit()
                else:
                    peer.check_host_updates()

        peer.run(train, state)
    return 0


# --- the cost -----------------------------------------------------------------------------------


def paired_overhead(base: list[list[float]], other: list[list[float]],
                    samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float, float]:
    """Overhead (%) of ``other`` against ``base`` (per rank, one value per round), paired
    by round: the median of ``other / base`` - 1 over rounds and ranks, with a 95 %
    bootstrap interval over rounds."""
    rounds = [[o / b for b, o in zip(bs, os_, strict=True) if b > 0]
              for bs, os_ in zip(zip(*base, strict=True), zip(*other, strict=True), strict=True)]
    point = statistics.median(x for rnd in rounds for x in rnd)
    rng = random.Random(0)
    medians = sorted(statistics.median(
        x for _ in range(len(rounds)) for x in rounds[rng.randrange(len(rounds))])
        for _ in range(samples))
    return (100 * (point - 1), 100 * (medians[int(0.025 * samples)] - 1),
            100 * (medians[int(0.975 * samples) - 1] - 1))


def run_cost(endpoint: str, world: int, rounds: int, steps: int) -> dict[str, Any]:
    from tests.helpers.procs import PeerProc

    env = dict(os.environ, PEER_ELASTIC_ETCD=endpoint,
               PEER_ELASTIC_JOB=f"straggler-cost-{world}-{secrets.token_hex(3)}",
               PEER_ELASTIC_MIN_NP=str(world), PEER_ELASTIC_MAX_NP=str(world),
               PEER_ELASTIC_BACKEND="gloo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "cost",
           "--rounds", str(rounds), "--steps", str(steps)]
    procs = [PeerProc(cmd, env, f"cost{i}") for i in range(world)]
    try:
        ranks = []
        for p in procs:
            code = p.wait(600 + rounds * steps)
            if code != 0:
                raise RuntimeError(f"{p.name} exited {code}:\n{p.output()}")
            ranks.append(json.loads(p.wait_line("RESULT", 5).split(" ", 1)[1]))
    finally:
        for p in procs:
            p.kill()
    ranks.sort(key=lambda r: r["rank"])
    on = [v for r in ranks for v in r["check_on_ns"]]
    off = [v for r in ranks for v in r["check_off_ns"]]
    point, lo, hi = paired_overhead([r["step_off_ns"] for r in ranks],
                                    [r["step_on_ns"] for r in ranks])
    cpu_point, cpu_lo, cpu_hi = paired_overhead([r["cpu_off_ns"] for r in ranks],
                                                [r["cpu_on_ns"] for r in ranks])
    step_on = statistics.median(v for r in ranks for v in r["step_on_ns"])
    step_off = statistics.median(v for r in ranks for v in r["step_off_ns"])
    return {
        "world": world, "rounds": rounds, "steps_per_block": steps,
        "check_on_mean_us": statistics.mean(on) / 1000,
        "check_off_mean_us": statistics.mean(off) / 1000,
        "check_on_median_us": statistics.median(on) / 1000,
        "check_off_median_us": statistics.median(off) / 1000,
        "check_on_p999_us": sorted(on)[int(0.999 * (len(on) - 1))] / 1000,
        "step_on_median_us": step_on / 1000, "step_off_median_us": step_off / 1000,
        "step_overhead_paired_median_pct": point, "step_overhead_ci95_pct": [lo, hi],
        "check_mean_added_us": (statistics.mean(on) - statistics.mean(off)) / 1000,
        "cpu_overhead_paired_median_pct": cpu_point, "cpu_overhead_ci95_pct": [cpu_lo, cpu_hi],
    }


def micro_costs(steps: int = 1500) -> dict[str, float]:
    """In this process, right after a training step of the MLP (the caches cold, as in a
    training loop): what a check's count costs (``StragglerWatch.at_check``; the exchange
    it calls for about once a second, in a group of one, is not in the sample), and what
    timing one gradient all-reduce costs (the thread's tally looked up, a wait entered and
    left), next to doing nothing; medians of interleaved samples."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from recovery_worker import build_model, forward_backward

    from peer_elastic.config import JobSettings
    from peer_elastic.straggler import waits
    from peer_elastic.straggler.watch import StragglerWatch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    coordinator = SimpleNamespace(config=JobSettings().resolved(), member_id="m", host="h",
                                  writer=None)
    group = SimpleNamespace(assignment=SimpleNamespace(rank=0, size=1, generation=1,
                                                       roster=("m",)))
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    watch = StragglerWatch(coordinator)
    kinds: dict[str, list[int]] = {"nothing": [], "at_check": [], "timed_wait": []}
    clock = time.perf_counter_ns
    try:
        for i in range(steps):
            opt.zero_grad()
            forward_backward(model, i, 0)
            opt.step()
            kind = list(kinds)[i % 3]
            t = clock()
            exchange = False
            if kind == "at_check":
                exchange = watch.at_check(group)
            elif kind == "timed_wait":
                tally = waits.tally()
                tally.enter_wait()
                tally.leave_wait()
            kinds[kind].append(clock() - t)
            if exchange:
                watch.exchange(group, torch.device("cpu"))
    finally:
        watch.close()
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in kinds.items()}
    return {"at_check_ns": med["at_check"] - med["nothing"],
            "timed_wait_ns": med["timed_wait"] - med["nothing"],
            "nothing_ns": med["nothing"]}


# --- the throughput -----------------------------------------------------------------------------


def steps_of(p: Any) -> list[tuple[float, int, int, int]]:
    """(unix, generation, world, samples) of every STEP line of rank 0's process."""
    with p.cond:
        return [(float(t), int(g), int(w), int(s)) for line in p.lines
                if line.startswith("STEP ") for _, t, g, w, s in [line.split()]]


def gens_of(p: Any) -> list[tuple[float, int, int, int]]:
    """(unix, generation, rank, world) of every GEN line."""
    with p.cond:
        return [(float(t), int(g), int(r), int(w)) for line in p.lines
                if line.startswith("GEN ") for _, t, g, r, w, _pid in [line.split()]]


def wait_until(what: str, found: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := found()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        time.sleep(0.1)
    return value


def throughput(lines: list[tuple[float, int, int, int]], start: float, end: float) -> float:
    """Samples per second trained between ``start`` and ``end`` (unix), from rank 0's
    STEP lines (each says the samples trained so far)."""
    inside = [(t, s) for t, _, _, s in lines if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


def straggler_event_at(client: Any, job: str) -> float | None:
    from peer_elastic.etcd.admin import current_run
    from peer_elastic.etcd.keys import RunKeys
    from peer_elastic.records import EventRecord, decode

    run, _ = current_run(client, job)
    kvs, _ = client.get_prefix(RunKeys(job, run.run_id).events_prefix)
    times = [ev.unix for kv in kvs if (ev := decode(EventRecord, kv.value, kv.key)).kind
             == "straggler"]
    return min(times) if times else None


def run_scenario(endpoint: str, name: str, peers: int, throttled: bool, policy: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    from peer_elastic.etcd.client import EtcdClient
    from tests.helpers.procs import PeerProc
    from tests.helpers.throttle import DutyCycle

    job = f"straggler-{name}-{secrets.token_hex(3)}"
    env = dict(os.environ, PEER_ELASTIC_ETCD=endpoint, PEER_ELASTIC_JOB=job,
               PEER_ELASTIC_MIN_NP="1", PEER_ELASTIC_BACKEND="gloo", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PEER_ELASTIC_START_SETTLE="2",
               PEER_ELASTIC_STRAGGLER_POLICY=policy,
               PEER_ELASTIC_STRAGGLER_WINDOW=str(args.window),
               PEER_ELASTIC_STRAGGLER_COOLDOWN=str(args.cooldown),
               PEER_ELASTIC_STRAGGLER_THRESHOLD=str(args.threshold),
               BENCH_HIDDEN="64", BENCH_BATCH="32")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "train",
           "--step-s", str(args.step_s)]
    procs = [PeerProc(cmd, env, f"{name}-{i}") for i in range(peers)]
    client = EtcdClient(endpoint)
    duty: DutyCycle | None = None
    out: dict[str, Any] = {"scenario": name, "peers": peers, "policy": policy,
                           "throttled": throttled}
    try:
        def formed() -> dict[int, Any] | None:
            by_rank = {}
            for p in procs:
                full = [g for g in gens_of(p) if g[3] == peers]
                if not full:
                    return None
                by_rank[full[-1][2]] = p
            return by_rank if len(by_rank) == peers else None

        by_rank = wait_until(f"world of {peers}", formed, 180)
        lead = by_rank[0]
        time.sleep(args.warmup)  # past the cooldown: the group's pace settled
        start = time.time() + (args.settle if throttled else 0.0)
        if throttled:
            duty = DutyCycle(by_rank[peers - 1].pid).start()
            out["throttle_unix"] = began = time.time()
            if policy == "evict":
                def evicted() -> float | None:
                    smaller = [t for t, _, _, w in gens_of(lead) if w == peers - 1]
                    return smaller[0] if smaller else None

                at = wait_until("eviction", evicted, 180)
                out["evicted_after_s"] = at - began
                start = at + args.settle
        end = start + args.measure
        time.sleep(max(0.0, end - time.time()) + 1.0)
        lines = steps_of(lead)
        out["samples_per_s"] = throughput(lines, start, end)
        out["window"] = [start, end]
        if throttled:
            seen = straggler_event_at(client, job)
            out["detected_after_s"] = None if seen is None else seen - out["throttle_unix"]
    finally:
        if duty is not None:
            duty.stop()
        for p in procs:
            p.kill()
        client.close()
    return out


# --- the report ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="cost,throughput", help="cost, throughput or both")
    ap.add_argument("--worlds", default="4", help="world sizes of the cost part (4)")
    ap.add_argument("--rounds", type=int, default=12, help="cost: rounds of two blocks")
    ap.add_argument("--steps", type=int, default=150, help="cost: steps per block")
    ap.add_argument("--step-s", type=float, default=0.03,
                    help="throughput: simulated device time per step (s)")
    ap.add_argument("--measure", type=float, default=30.0, help="throughput: seconds measured")
    ap.add_argument("--warmup", type=float, default=8.0,
                    help="throughput: seconds after the group formed before anything")
    ap.add_argument("--settle", type=float, default=4.0,
                    help="throughput: seconds after the throttle or the eviction before "
                         "measuring")
    ap.add_argument("--window", type=float, default=10.0, help="straggler_window_s")
    ap.add_argument("--cooldown", type=float, default=5.0, help="straggler_cooldown_s")
    ap.add_argument("--threshold", type=float, default=2.0, help="straggler_threshold")
    ap.add_argument("--commit-every", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", choices=("cost", "train"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "cost":
        return cost_worker(args.rounds, args.steps)
    if args.worker == "train":
        return train_worker(args.step_s, args.commit_every)

    import torch

    import peer_elastic
    from peer_elastic.etcd_server import EtcdServer
    from peer_elastic.straggler.meter import EXCHANGE_EVERY_S

    parts = {p.strip() for p in args.parts.split(",")}
    doc: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "peer_elastic": peer_elastic.__version__,
                    "load_average": os.getloadavg()},
        "args": vars(args)}
    with EtcdServer() as server:
        if "cost" in parts:
            doc["micro"] = micro = micro_costs()
            print(f"after a training step: a check's count costs {micro['at_check_ns'] / 1000:.1f}"
                  f" us, timing one all-reduce {micro['timed_wait_ns'] / 1000:.1f} us (doing "
                  f"nothing: {micro['nothing_ns'] / 1000:.1f} us)", flush=True)
            doc["cost"] = []
            for world in (int(w) for w in args.worlds.split(",") if w.strip()):
                r = run_cost(server.endpoint, world, args.rounds, args.steps)
                doc["cost"].append(r)
                lo, hi = r["step_overhead_ci95_pct"]
                print(f"cost, world {world}: check mean {r['check_off_mean_us']:.1f} us "
                      f"without measuring, {r['check_on_mean_us']:.1f} us with "
                      f"({r['check_mean_added_us']:+.1f} us); median "
                      f"{r['check_off_median_us']:.1f} / {r['check_on_median_us']:.1f} us; "
                      f"p99.9 with {r['check_on_p999_us']:.0f} us (the exchanges) | step "
                      f"{r['step_off_median_us']:.0f} us, overhead "
                      f"{r['step_overhead_paired_median_pct']:+.2f} % paired median, 95 % CI "
                      f"[{lo:+.2f}, {hi:+.2f}]; CPU per step "
                      f"{r['cpu_overhead_paired_median_pct']:+.2f} % [{r['cpu_overhead_ci95_pct'][0]:+.2f}, "
                      f"{r['cpu_overhead_ci95_pct'][1]:+.2f}]", flush=True)
        if "throughput" in parts:
            doc["throughput"] = []
            for name, peers, throttled, policy in (
                    ("healthy-4", 4, False, "report"),
                    ("throttled-4-report", 4, True, "report"),
                    ("throttled-4-evict", 4, True, "evict"),
                    ("healthy-3", 3, False, "report")):
                r = run_scenario(server.endpoint, name, peers, throttled, policy, args)
                doc["throughput"].append(r)
                extra = ""
                if throttled:
                    det = r.get("detected_after_s")
                    extra = (f", straggler event {det:.1f} s after the throttle began"
                             if det is not None else ", no straggler event")
                    if "evicted_after_s" in r:
                        extra += f", evicted after {r['evicted_after_s']:.1f} s"
                print(f"{name}: {r['samples_per_s']:.0f} samples/s{extra}", flush=True)
            by = {r["scenario"]: r for r in doc["throughput"]}
            base = by["healthy-3"]["samples_per_s"]
            print()
            print("scenario            | samples/s | vs healthy-3")
            for r in doc["throughput"]:
                ratio = r["samples_per_s"] / base if base else 0.0
                print(f"{r['scenario']:<19} | {r['samples_per_s']:9.0f} | {ratio:6.2f}")
            evict = by["throttled-4-evict"]
            ratio = evict["samples_per_s"] / base if base else 0.0
            detected = evict.get("detected_after_s")
            doc["targets"] = {
                "evict_vs_healthy_3": ratio,
                "evict_at_least_90_pct": ratio >= EVICT_TARGET,
                # the window, plus the few measurements it takes to see the first slow one
                "detected_within_window": detected is not None
                and detected <= args.window + DETECTION_SLACK_EXCHANGES * EXCHANGE_EVERY_S,
            }
            seen = f"{detected:.1f} s" if detected is not None else "none"
            print(f"evict / healthy-3 = {ratio:.2f} (target >= {EVICT_TARGET}); detection "
                  f"{seen} after the throttle, window {args.window:.0f} s (target: within "
                  f"it plus {DETECTION_SLACK_EXCHANGES} exchanges)")
    print(f"load average at the end: {os.getloadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
