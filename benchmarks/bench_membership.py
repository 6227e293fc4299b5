"""Membership at scale: join convergence, leave propagation, steady etcd load.

One etcd server (started here, on a free loopback port) and ``--procs`` worker processes.
Each worker hosts its share of the N simulated members: N/procs :class:`Coordinator`
objects that share one :class:`EtcdClient`, one :class:`JobView` and one
:class:`LeaseKeeper`, as peers in one process would. The driver process only sends
commands and collects wall-clock times (``time.time()``, same machine for every process).

What is measured, for each N:

(a) join convergence: every member joins at once (each worker registers its members one
    after another, the workers in parallel). From the LAST member's registration (the time
    its registration transaction was sent) until every worker's view first shows a
    generation whose roster lists all N members (max over workers). Also reported: when
    the leader wrote that generation (``written_unix``, so the settle delay shows), and
    when every member had acknowledged it (each coordinator thread reacted).
(b) leave propagation: a member that is not the leader closes (``Coordinator.close()``,
    which revokes its lease). From the revoke request until every view has a generation
    without it (median and p90 over several leaves), and until every view saw its member
    key deleted (pure watch latency). ``close()``'s own duration is reported too, and one
    leave of the leader itself is measured separately.
(c) steady state: over a quiet window with no membership change, etcd requests per member
    per minute, counted two ways: client side (every public request method of each
    worker's EtcdClient is wrapped by a counter) and server side (etcd's
    ``grpc_server_started_total`` from ``/metrics``, everything the server received).
    Worker CPU time over the window is reported as well.

Plus (d) a late join into the settled job: one new member joins; from its registration
until every view shows a generation with it (median of a few).

Usage::

    python benchmarks/bench_membership.py --out results.json          # N = 8, 64, 256 (~2.5 min)
    python benchmarks/bench_membership.py --quick --out quick.json    # N = 8, 64, short windows
    python benchmarks/bench_membership.py --sizes 8,64 --procs 4
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import random
import re
import secrets
import signal
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import EtcdClient, KeyValue, WatchEvent
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.lease import LeaseKeeper
from peer_elastic.etcd.view import JobView, ViewSnapshot
from peer_elastic.etcd_server import EtcdServer

#: EtcdClient methods that each send (at least) one request to etcd. ``create`` and
#: ``compare_and_put`` go through ``txn`` and are counted there.
# keepalive_many (one stream refreshing every due lease of a process) counts as one request.
COUNTED = ("get", "get_prefix", "put", "delete", "txn", "grant", "keepalive", "keepalive_many",
           "revoke", "lease_ttl", "watch_prefix", "cancel_watch", "revision", "compact")

TARGET_JOIN_S = 2.0  # N = 256: converge within 2 s of the last join
TARGET_LEAVE_MS = 100.0  # N = 64: a leave seen everywhere within 100 ms (median)
REPLY_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    pass


# --- worker side ----------------------------------------------------------------------------


class CallCounter:
    """Counts calls of the client's request methods (patched on the instance)."""

    def __init__(self, client: EtcdClient) -> None:
        self.counts = dict.fromkeys(COUNTED, 0)
        self.keepalive_by_lease: dict[int, int] = {}
        self.revoke_sent: dict[int, float] = {}
        self.local = threading.local()
        self._lock = threading.Lock()
        for name in COUNTED:
            setattr(client, name, self._wrap(name, getattr(client, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            now = time.time()
            with self._lock:
                self.counts[name] += 1
                if name == "keepalive" and args:
                    self.keepalive_by_lease[args[0]] = self.keepalive_by_lease.get(args[0], 0) + 1
                elif name == "revoke" and args:
                    self.revoke_sent[args[0]] = now
            if name == "txn":
                self.local.last_txn = now  # a member's registration is its last txn in start()
            return fn(*args, **kwargs)

        return counted


def _gen_ok(snap: ViewSnapshot, acked: bool) -> bool:
    gen = snap.generation
    return gen is not None and (not acked or set(gen.roster) <= snap.ready_for(gen.number))


def make_predicate(spec: list[Any]) -> Callable[[ViewSnapshot], bool]:
    """Probe predicates by name (specs travel between processes as plain lists)."""
    kind = spec[0]
    if kind in ("full", "full_acked"):  # a generation newer than g with exactly n members
        n, g, acked = spec[1], spec[2], kind == "full_acked"
        return lambda s: (_gen_ok(s, acked) and s.generation.number > g
                          and len(s.generation.roster) == n)
    if kind == "gone":  # the member key is gone from the view
        m = spec[1]
        return lambda s: m not in s.members
    if kind in ("without", "without_acked"):  # a generation newer than g without m
        m, g, acked = spec[1], spec[2], kind == "without_acked"
        return lambda s: (_gen_ok(s, acked) and s.generation.number > g
                          and m not in s.generation.roster)
    raise BenchError(f"unknown probe {spec!r}")


class TimedView(JobView):
    """A JobView that notes the wall time at which a predicate first held after an apply.

    The time is taken in the watch thread right after the view applied a watch response,
    i.e. when every member in this process could first read the new picture.
    """

    def __init__(self, client: EtcdClient, job: str) -> None:
        super().__init__(client, job)
        self._probes: dict[str, dict[str, Any]] = {}
        self._probe_lock = threading.Lock()
        self.applies = 0

    def _apply_snapshot(self, kvs: list[KeyValue], revision: int) -> None:
        super()._apply_snapshot(kvs, revision)
        self._fire(time.time())

    def _apply_events(self, events: list[WatchEvent], revision: int) -> None:
        super()._apply_events(events, revision)
        self._fire(time.time())

    def _fire(self, now: float, only: str | None = None) -> None:
        self.applies += 1
        with self._probe_lock:
            pending = [(k, p) for k, p in self._probes.items()
                       if p["t"] is None and (only is None or k == only)]
        if not pending:
            return
        snap = self.snapshot()
        for _name, p in pending:
            if p["pred"](snap):
                with self._probe_lock:
                    if p["t"] is None:
                        gen = snap.generation
                        p.update(t=now, gen=gen.number if gen else 0,
                                 written=gen.written_unix if gen else 0.0,
                                 already=only is not None)

    def add_probe(self, name: str, spec: list[Any]) -> None:
        with self._probe_lock:
            self._probes[name] = {"pred": make_predicate(spec), "t": None}
        self._fire(time.time(), only=name)  # already true when installed: flagged

    def probe_results(self, names: list[str]) -> dict[str, dict[str, Any] | None]:
        with self._probe_lock:
            out = {}
            for n in names:
                p = self._probes.get(n)
                out[n] = None if p is None or p["t"] is None else {
                    k: v for k, v in p.items() if k != "pred"}
            return out


class Worker:
    def __init__(self, idx: int, endpoint: str, job: str, settings: dict[str, Any]) -> None:
        self.idx = idx
        self.job = job
        self.client = EtcdClient(endpoint, retry_budget_s=15)
        self.counter = CallCounter(self.client)
        self.view = TimedView(self.client, job)
        # The worker holds the shared view itself, so it keeps watching after the last
        # of its members left (each Coordinator.close() releases one use of the view).
        self.view.start()
        self.keeper = LeaseKeeper(self.client, name=f"bench-keeper-{idx}")
        self.settings = JobSettings(**settings)
        self.coords: dict[str, Coordinator] = {}
        self.closed_stats: dict[str, int] = {}
        self.run_lease = 0

    def join(self, k: int, at_once: int = 1) -> list[dict[str, Any]]:
        """Register ``k`` members, ``at_once`` of them side by side (as that many peers
        starting together would); each waits until its own view shows it."""
        lock = threading.Lock()

        def one(_: int) -> dict[str, Any]:
            c = Coordinator(self.client, self.job, self.settings, host=f"w{self.idx}",
                            view=self.view, keeper=self.keeper)
            self.counter.local.last_txn = 0.0  # thread-local: this registration's own
            c.start()
            ret = time.time()
            with lock:
                self.coords[c.member_id] = c
                self.run_lease = c.run.lease_id if c.run is not None else 0
            m = self.view.snapshot().members.get(c.member_id)
            return {"id": c.member_id, "put_t": self.counter.local.last_txn, "ret_t": ret,
                    "rev": m.create_revision if m else 0, "worker": self.idx}

        if at_once <= 1:
            return [one(i) for i in range(k)]
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            return list(pool.map(one, range(k)))

    def probe(self, probes: dict[str, list[Any]]) -> bool:
        for name, spec in probes.items():
            self.view.add_probe(name, spec)
        return True

    def wait(self, names: list[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            res = self.view.probe_results(names)
            if all(v is not None for v in res.values()) or time.monotonic() > deadline:
                return res
            time.sleep(0.02)

    def leave(self, member_id: str) -> dict[str, Any]:
        key = next(k for k, c in self.coords.items() if c.member_id == member_id)
        c = self.coords.pop(key)
        lease = c.lease_id
        t_call = time.time()
        c.close()
        t_ret = time.time()
        self._add_stats(c)
        return {"call_t": t_call, "ret_t": t_ret, "revoke_t": self.counter.revoke_sent.get(lease)}

    def state(self) -> dict[str, Any]:
        snap = self.view.snapshot()
        gen = snap.generation
        return {"gen": gen.number if gen else 0, "roster": list(gen.roster) if gen else [],
                "by_age": [m.id for m in snap.by_age],
                "local": [c.member_id for c in self.coords.values()],  # ids change on rejoin
                "run_lease": self.run_lease}

    def counts(self) -> dict[str, Any]:
        run_lease = self.state()["run_lease"]
        with self.counter._lock:
            counts = dict(self.counter.counts)
            ka_run = self.counter.keepalive_by_lease.get(run_lease, 0)
        return {"counts": counts, "keepalive_run_lease": ka_run, "cpu": time.process_time(),
                "wall": time.time(), "threads": threading.active_count(),
                "members": len(self.coords), "applies": self.view.applies}

    def _add_stats(self, c: Coordinator) -> None:
        for k, v in c.counters.as_dict().items():
            self.closed_stats[k] = self.closed_stats.get(k, 0) + v

    def stats(self) -> dict[str, int]:
        out = dict(self.closed_stats)
        for c in self.coords.values():
            for k, v in c.counters.as_dict().items():
                out[k] = out.get(k, 0) + v
        out["errors"] = sum(1 for c in self.coords.values() if c.error is not None)
        return out

    def shutdown(self) -> dict[str, int]:
        stats = self.stats()
        coords = list(self.coords.values())
        self.coords.clear()
        pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(coords))))
        futures = [pool.submit(c.close) for c in coords]
        futures_wait(futures, timeout=20)
        pool.shutdown(wait=False, cancel_futures=True)
        self.keeper.stop()
        self.view.stop()
        self.client.close()
        return stats


def worker_main(idx: int, conn: Any, endpoint: str, job: str, settings: dict[str, Any],
                log_level: str = "ERROR") -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s [w{idx}] %(levelname)s %(name)s: %(message)s")
    try:
        w = Worker(idx, endpoint, job, settings)
        conn.send({"ok": True, "pid": os.getpid()})
    except Exception as exc:  # report, then exit
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            w.shutdown()
            return
        try:
            if cmd == "shutdown":
                conn.send({"ok": w.shutdown()})
                return
            fn = getattr(w, cmd)
            result = fn(**arg) if isinstance(arg, dict) else fn()
            conn.send({"ok": result})
        except Exception as exc:
            conn.send({"error": f"{cmd}: {type(exc).__name__}: {exc}"})


# --- driver side ----------------------------------------------------------------------------


class Pool:
    """The worker processes of one N; every call has a bounded wait."""

    def __init__(self, procs: int, endpoint: str, job: str, settings: dict[str, Any],
                 log_level: str = "ERROR") -> None:
        ctx = mp.get_context("spawn")  # no fork: gRPC threads do not survive it
        self.conns = []
        self.procs = []
        for i in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(i, child, endpoint, job, settings, log_level),
                            name=f"bench-worker-{i}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for i in range(procs):
            self._recv(i, 60)

    def _recv(self, i: int, timeout: float = REPLY_TIMEOUT_S) -> Any:
        if not self.conns[i].poll(timeout):
            raise BenchError(f"worker {i} did not answer within {timeout:.0f} s")
        reply = self.conns[i].recv()
        if "error" in reply:
            raise BenchError(f"worker {i}: {reply['error']}")
        return reply["ok"]

    def call(self, i: int, cmd: str, arg: Any = None, timeout: float = REPLY_TIMEOUT_S) -> Any:
        self.conns[i].send((cmd, arg))
        return self._recv(i, timeout)

    def call_all(self, cmd: str, args: list[Any] | Any = None,
                 timeout: float = REPLY_TIMEOUT_S) -> list[Any]:
        per = args if isinstance(args, list) else [args] * len(self.conns)
        for conn, arg in zip(self.conns, per, strict=True):
            conn.send((cmd, arg))
        return [self._recv(i, timeout) for i in range(len(self.conns))]

    def close(self) -> list[Any]:
        stats: list[Any] = []
        for conn in self.conns:
            try:
                conn.send(("shutdown", None))
            except (OSError, BrokenPipeError):
                continue
        for i in range(len(self.conns)):
            try:
                stats.append(self._recv(i, 30))
            except (BenchError, EOFError, OSError) as exc:
                stats.append({"error": str(exc)})
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        return stats


def server_counts(url: str) -> dict[str, float]:
    """etcd's grpc_server_started_total by service/method, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    pat = re.compile(r'^grpc_server_started_total\{(.*)\}\s+([0-9.e+]+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = f"{labels.get('grpc_service', '?').split('.')[-1]}.{labels.get('grpc_method', '?')}"
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def worst(results: list[dict[str, Any]], name: str, required: bool = True) -> Any:
    """The latest (slowest) observation of probe ``name`` over all workers.

    A probe that never held on some worker raises, or gives None when not ``required``.
    """
    seen = [r[name] for r in results]
    if any(v is None for v in seen):
        if not required:
            return None
        missing = [i for i, v in enumerate(seen) if v is None]
        raise BenchError(f"probe {name} never held on worker(s) {missing}")
    return max(seen, key=lambda v: v["t"])


def run_size(server: EtcdServer, n: int, args: argparse.Namespace,
             out: dict[str, Any]) -> None:
    """Measure one N; results go into ``out`` as they come (kept if a later step fails)."""
    job = f"bench-m{n}-{secrets.token_hex(3)}"
    settings = dict(min_np=1, max_np=0, start_settle_s=args.start_settle, settle_s=args.settle,
                    lease_ttl_s=args.lease_ttl, join_timeout_s=args.join_timeout,
                    run_ttl_s=args.run_ttl)
    procs = max(1, min(args.procs, n))
    rng = random.Random(args.seed + n)
    out.update(n=n, procs=procs, job=job, settings=settings)
    t_begin = time.time()
    pool = Pool(procs, server.endpoint, job, settings, args.log_level)
    try:
        # (a) join burst
        pool.call_all("probe", {"probes": {"join_full": ["full", n, 0],
                                           "join_acked": ["full_acked", n, 0]}})
        shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        cj0 = pool.call_all("counts")
        # Each worker registers its share (--register-at-once side by side), each member
        # waiting until its view shows it: on a loaded machine that takes longer than one
        # reply's usual wait.
        joined = [m for r in pool.call_all(
            "join", [{"k": k, "at_once": args.register_at_once} for k in shares],
            max(REPLY_TIMEOUT_S, 0.5 * max(shares)))
            for m in r]
        last_put = max(m["put_t"] for m in joined)
        first_put = min(m["put_t"] for m in joined)
        res = pool.call_all("wait", {"names": ["join_full", "join_acked"], "timeout": 60}, 90)
        full, acked = worst(res, "join_full"), worst(res, "join_acked")
        # CPU of every worker from before the first registration until all acked (plus the
        # wait's own polling): what joining costs per member, whoever spends it.
        join_cpu = sum(b["cpu"] - a["cpu"] for a, b in zip(cj0, pool.call_all("counts"),
                                                            strict=True))
        out["join"] = {
            "register_span_s": last_put - first_put,
            "converge_s": full["t"] - last_put,
            "converge_from_start_return_s": full["t"] - max(m["ret_t"] for m in joined),
            "generation_written_after_last_join_s": full["written"] - last_put,
            "propagation_after_write_s": full["t"] - full["written"],
            "all_acked_s": acked["t"] - last_put,
            "worker_cpu_s": join_cpu,
            "worker_cpu_ms_per_member": join_cpu / n * 1e3,
            "generation": full["gen"],
        }
        log(f"N={n}: registered in {last_put - first_put:.2f} s; converged "
            f"{out['join']['converge_s']:.3f} s after the last join (generation "
            f"{full['gen']} written after {out['join']['generation_written_after_last_join_s']:.3f} s); "
            f"all acked after {out['join']['all_acked_s']:.3f} s; worker CPU "
            f"{join_cpu / n * 1e3:.1f} ms per member")

        # (c) steady state: no membership change
        time.sleep(args.quiet)
        c0, s0, t0 = pool.call_all("counts"), server_counts(server.client_url), time.time()
        m0 = cpu_sample()
        time.sleep(args.steady)
        c1, s1, t1 = pool.call_all("counts"), server_counts(server.client_url), time.time()
        machine_busy = busy_between(m0, cpu_sample())
        minutes = (t1 - t0) / 60.0
        by_method = {k: sum(b["counts"][k] - a["counts"][k] for a, b in zip(c0, c1, strict=True))
                     for k in COUNTED}
        client_total = sum(by_method.values())
        run_ka = sum(b["keepalive_run_lease"] - a["keepalive_run_lease"] for a, b in zip(c0, c1, strict=True))
        server_by = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1 if s1.get(k, 0) != s0.get(k, 0)}
        cpu = sum(b["cpu"] - a["cpu"] for a, b in zip(c0, c1, strict=True))
        out["steady"] = {
            "window_s": t1 - t0,
            "client_requests": client_total,
            "client_by_method": {k: v for k, v in by_method.items() if v},
            "client_keepalive_run_lease": run_ka,
            "member_lease_keepalives_per_member_per_min":
                (by_method["keepalive"] - run_ka) / n / minutes,
            "run_lease_keepalives_per_min": run_ka / minutes,
            "client_per_member_per_min": client_total / n / minutes,
            "server_requests": sum(server_by.values()),
            "server_by_method": server_by,
            "server_per_member_per_min": sum(server_by.values()) / n / minutes,
            "worker_cpu_s_per_s": cpu / (t1 - t0),
            "worker_cpu_ms_per_member_per_s": cpu / (t1 - t0) / n * 1e3,
            # all CPUs of the machine, every process (etcd, workers, anything else running)
            "machine_cpu_busy": machine_busy,
            "cpus": os.cpu_count(),
            "threads_per_worker": [b["threads"] for b in c1],
        }
        log(f"N={n}: steady {out['steady']['client_per_member_per_min']:.1f} (client) / "
            f"{out['steady']['server_per_member_per_min']:.1f} (server) requests/member/min; "
            f"workers use {out['steady']['worker_cpu_s_per_s']:.2f} CPU")

        # (b) leaves of non-leaders, then one of the leader
        leaves = []
        n_leaves = max(0, min(args.leaves, n - 2))
        for i in range(n_leaves + 1):
            states = pool.call_all("state")
            owner = {m: w for w, st in enumerate(states) for m in st["local"]}
            by_age = [m for m in states[0]["by_age"] if m in owner]
            is_leader_leave = i == n_leaves
            victim = by_age[0] if is_leader_leave else rng.choice(by_age[1:])
            g = states[0]["gen"]
            probes = {f"gone{i}": ["gone", victim], f"gen{i}": ["without", victim, g],
                      f"ack{i}": ["without_acked", victim, g]}
            pool.call_all("probe", {"probes": probes})
            r = pool.call(owner[victim], "leave", {"member_id": victim})
            res = pool.call_all("wait", {"names": list(probes), "timeout": 20}, 40)
            t_leave = r["revoke_t"] or r["call_t"]
            gone, gen = worst(res, f"gone{i}"), worst(res, f"gen{i}")
            ack = worst(res, f"ack{i}", required=False)  # None: not all acked within 20 s
            leaves.append({
                "leader": is_leader_leave,
                "close_s": r["ret_t"] - r["call_t"],
                "close_until_revoke_s": t_leave - r["call_t"],
                "watch_delete_s": gone["t"] - t_leave,
                "generation_written_s": gen["written"] - t_leave,
                "generation_everywhere_s": gen["t"] - t_leave,
                "acked_everywhere_s": None if ack is None else ack["t"] - t_leave,
            })
            time.sleep(args.gap)
        normal = [x for x in leaves if not x["leader"]]
        out["leaves"] = leaves
        if normal:
            ev = [x["generation_everywhere_s"] * 1e3 for x in normal]
            wd = [x["watch_delete_s"] * 1e3 for x in normal]
            wr = [x["generation_written_s"] * 1e3 for x in normal]
            out["leave"] = {
                "count": len(normal),
                "everywhere_median_ms": statistics.median(ev), "everywhere_p90_ms": pct(ev, 0.9),
                "watch_delete_median_ms": statistics.median(wd), "watch_delete_p90_ms": pct(wd, 0.9),
                "written_median_ms": statistics.median(wr),
                "close_median_ms": statistics.median(x["close_s"] * 1e3 for x in normal),
                "acked_median_ms": statistics.median(
                    x["acked_everywhere_s"] * 1e3 if x["acked_everywhere_s"] is not None
                    else math.inf for x in normal),
                "leader_leave_everywhere_ms": leaves[-1]["generation_everywhere_s"] * 1e3,
            }
            log(f"N={n}: leave seen everywhere median {out['leave']['everywhere_median_ms']:.1f} "
                f"ms, p90 {out['leave']['everywhere_p90_ms']:.1f} ms (written after "
                f"{out['leave']['written_median_ms']:.1f} ms); key delete everywhere median "
                f"{out['leave']['watch_delete_median_ms']:.1f} ms")

        # (d) late joins into the settled job
        late = []
        for i in range(args.late_joins):
            st = pool.call(0, "state")
            size = len(st["by_age"]) + 1
            probes = {f"late{i}": ["full", size, st["gen"]],
                      f"lateack{i}": ["full_acked", size, st["gen"]]}
            pool.call_all("probe", {"probes": probes})
            w = i % procs
            m = pool.call(w, "join", {"k": 1})[0]
            res = pool.call_all("wait", {"names": list(probes), "timeout": 20}, 40)
            seen = worst(res, f"late{i}")
            acked = worst(res, f"lateack{i}", required=False)  # settled before the next join
            late.append({"everywhere_s": seen["t"] - m["put_t"],
                         "written_s": seen["written"] - m["put_t"],
                         "acked_s": None if acked is None else acked["t"] - m["put_t"]})
            time.sleep(args.gap)
        if late:
            out["late_join"] = {
                "count": len(late),
                "everywhere_median_ms": statistics.median(x["everywhere_s"] * 1e3 for x in late),
                "written_median_ms": statistics.median(x["written_s"] * 1e3 for x in late),
            }
    finally:
        stats = pool.close()
        out["coordinator_stats"] = stats
        out["wall_s"] = time.time() - t_begin


def cpu_sample() -> tuple[int, int] | None:
    """(busy, idle) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, idle


def busy_between(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float | None:
    """Fraction of all CPUs busy between two samples."""
    if a is None or b is None:
        return None
    busy, idle = b[0] - a[0], b[1] - a[1]
    return busy / max(1, busy + idle)


def cpu_busy(seconds: float = 1.0) -> float | None:
    a = cpu_sample()
    time.sleep(seconds)
    return busy_between(a, cpu_sample())


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S ") + msg, file=sys.stderr, flush=True)


def _f(d: dict[str, Any] | None, key: str, spec: str, scale: float = 1.0) -> str:
    v = None if d is None else d.get(key)
    return "-" if v is None else format(v * scale, spec)


def fmt_table(results: list[dict[str, Any]]) -> str:
    lines = ["| N | join converge (s) | leave everywhere median / p90 (ms) "
             "| watch delete median (ms) | requests/member/min (client) | (server) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        j, lv, st = r.get("join"), r.get("leave"), r.get("steady")
        lines.append(f"| {r['n']} | {_f(j, 'converge_s', '.3f')} | "
                     f"{_f(lv, 'everywhere_median_ms', '.1f')} / {_f(lv, 'everywhere_p90_ms', '.1f')}"
                     f" | {_f(lv, 'watch_delete_median_ms', '.1f')} | "
                     f"{_f(st, 'client_per_member_per_min', '.1f')} | "
                     f"{_f(st, 'server_per_member_per_min', '.1f')} |")
    lines += ["", "| N | register span (s) | gen written after last join (s) | all acked (s) "
              "| leave: written (ms) | leave: all acked (ms) | leader leave (ms) "
              "| close() (ms) | late join (ms) | worker CPU (cores) "
              "| CPU/member: join (ms) / idle (ms/s) | CAS lost / dropped / rejoins |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        j, lv, st = r.get("join"), r.get("leave"), r.get("steady")
        stats = [x for x in r.get("coordinator_stats", []) if "error" not in x]
        tot = {k: sum(x.get(k, 0) for x in stats) for k in ("cas_lost", "dropped", "rejoins")}
        lines.append(
            f"| {r['n']} | {_f(j, 'register_span_s', '.2f')} | "
            f"{_f(j, 'generation_written_after_last_join_s', '.3f')} | "
            f"{_f(j, 'all_acked_s', '.3f')} | {_f(lv, 'written_median_ms', '.1f')} | "
            f"{_f(lv, 'acked_median_ms', '.1f')} | {_f(lv, 'leader_leave_everywhere_ms', '.1f')} | "
            f"{_f(lv, 'close_median_ms', '.0f')} | "
            f"{_f(r.get('late_join'), 'everywhere_median_ms', '.1f')} | "
            f"{_f(st, 'worker_cpu_s_per_s', '.2f')} | "
            f"{_f(j, 'worker_cpu_ms_per_member', '.1f')} / "
            f"{_f(st, 'worker_cpu_ms_per_member_per_s', '.3f')} | "
            f"{tot['cas_lost']} / {tot['dropped']} / {tot['rejoins']} |")
    for r in results:
        if "error" in r:
            lines.append(f"N={r['n']} failed: {r['error']}")
    return "\n".join(lines)


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        if r["n"] == 256 and r.get("join"):
            out["join_256_within_2s"] = {"value_s": r["join"]["converge_s"],
                                         "met": r["join"]["converge_s"] <= TARGET_JOIN_S}
        if r["n"] == 64 and r.get("leave"):
            v = r["leave"]["everywhere_median_ms"]
            out["leave_64_median_within_100ms"] = {"value_ms": v, "met": v <= TARGET_LEAVE_MS}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 8,64,256; "
                                                  "--quick: 8,64)")
    ap.add_argument("--procs", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--register-at-once", type=int, default=1,
                    help="members each worker registers side by side (default 1: one after "
                         "another)")
    ap.add_argument("--quick", action="store_true", help="short windows, fewer repetitions")
    ap.add_argument("--leaves", type=int, default=None, help="non-leader leaves per N (8; quick 5)")
    ap.add_argument("--late-joins", type=int, default=None, help="late joins per N (3; quick 2)")
    ap.add_argument("--steady", type=float, default=None,
                    help="steady-state window in s (25; quick 8)")
    ap.add_argument("--quiet", type=float, default=2.0,
                    help="wait after convergence before the steady window (s)")
    ap.add_argument("--gap", type=float, default=0.3, help="pause between leaves/joins (s)")
    ap.add_argument("--start-settle", type=float, default=1.0, help="start_settle_s (default 1.0)")
    ap.add_argument("--settle", type=float, default=0.05, help="settle_s (default 0.05)")
    ap.add_argument("--lease-ttl", type=float, default=5.0, help="lease_ttl_s (default 5)")
    ap.add_argument("--join-timeout", type=float, default=1.0, help="join_timeout_s (default 1)")
    ap.add_argument("--run-ttl", type=float, default=10.0, help="run_ttl_s (default 10)")
    ap.add_argument("--no-fsync", action="store_true", help="run etcd with --unsafe-no-fsync")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-level", default="ERROR", help="log level inside the workers")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or ("8,64" if args.quick else "8,64,256")).split(",")]
    args.leaves = args.leaves if args.leaves is not None else (5 if args.quick else 8)
    args.late_joins = args.late_joins if args.late_joins is not None else (2 if args.quick else 3)
    args.steady = args.steady if args.steady is not None else (8.0 if args.quick else 25.0)

    results = []
    started = time.time()
    busy_before = cpu_busy()
    if busy_before is not None and busy_before > 0.25:
        log(f"warning: the CPUs are {busy_before:.0%} busy before the run; other processes "
            "compete for them and the latencies will be worse than on a quiet machine")
    with EtcdServer(unsafe_no_fsync=args.no_fsync) as server:
        log(f"etcd {server.endpoint} (pid {server.pid}); sizes {sizes}, {args.procs} workers")
        for n in sizes:
            out: dict[str, Any] = {"n": n}
            results.append(out)
            try:
                run_size(server, n, args, out)
            except (BenchError, OSError, EOFError) as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
                log(f"N={n}: FAILED: {out['error']}")
    report = {
        "benchmark": "membership",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "args": vars(args),
        "cpu_busy_before": busy_before,
        "results": results,
        "targets": targets(results),
        "wall_s": time.time() - started,
    }
    print(fmt_table(results))
    for name, t in report["targets"].items():
        print(f"target {name}: {'MET' if t['met'] else 'NOT MET'} ({t})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
