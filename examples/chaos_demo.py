"""Chaos demo: train the digits classifier while peers are killed, stopped, drained and added.

It starts an embedded etcd and N peers of ``examples/train_digits.py``, then disturbs them on
a seeded schedule (the first action is always a crash):

* ``kill``  SIGKILL: a crash. The survivors roll back to their last commit and re-form.
* ``term``  SIGTERM: a graceful leave. Everyone resets at the next commit; nothing is redone.
* ``stop``  SIGSTOP for longer than the lease TTL, then SIGCONT: a stalled or partitioned
            peer. Its lease ends, the others go on without it, and when it wakes up it
            rejoins as a new member.
* ``add``   start one more peer: it joins at the next commit and receives the state.

At least ``--min-np`` peers are kept running (an action that would go below is replaced by
``add``). Every action and every membership event is printed as it happens (the run's event
log is polled twice a second), then the final test accuracy and a summary. Everything is
bounded by ``--duration``; all children are killed on exit, Ctrl-C included. The exit code is
0 only when the job finished successfully and reported its accuracy.

    python examples/chaos_demo.py                  # about a minute
    python examples/chaos_demo.py --quick          # about 20 s
    python examples/chaos_demo.py --seed 1234      # replay a schedule
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer_elastic.errors import PeerElasticError, RecordError
from peer_elastic.etcd.admin import job_status
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd_server import EtcdServer
from peer_elastic.records import EventRecord, decode

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_digits.py"
ACTIONS = ("kill", "term", "stop", "add")
ACCURACY = re.compile(r"test accuracy (\d+\.\d+)")
# Peer output worth showing without --verbose.
INTERESTING = ("test accuracy", "peer-elastic:", "Traceback", "Error", "error:")


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    killed: bool = False  # SIGKILLed by us: any exit code is expected
    leaving: bool = False  # SIGTERMed by us: should exit 0
    cont_at: float | None = None  # SIGSTOPped by us; SIGCONT due at this monotonic time
    stops: int = 0
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def healthy(self) -> bool:
        """Running and expected to stay in the job (not killed, stopped or leaving)."""
        return self.running and not (self.killed or self.leaving or self.cont_at is not None)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.print_lock = threading.Lock()
        self.peers: list[Peer] = []
        self.server: EtcdServer | None = None
        self.client: EtcdClient | None = None
        self.job = f"chaos-{args.seed}-{os.getpid()}"
        self.env: dict[str, str] = {}
        self.actions: list[tuple[float, str, str]] = []  # (t, kind, peer)
        self.seen_events: set[str] = set()
        self.generations: list[tuple[int, str]] = []  # (number, reason) of every generation
        self.member_names: dict[str, str] = {}
        self.done: dict[str, Any] | None = None
        self.accuracy_line: str | None = None
        self.training_started = False
        self.closed = False

    # --- output ---------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        with self.print_lock:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def named(self, text: str) -> str:
        """``text`` with member ids replaced by our peer names, where we know them."""
        for member, name in self.member_names.items():
            text = text.replace(member, f"{name}({member})")
        return text

    # --- peers ----------------------------------------------------------------------------

    def spawn(self) -> Peer:
        name = f"peer{len(self.peers)}"
        a = self.args
        cmd = [sys.executable, str(TRAIN), "--epochs", str(a.epochs),
               "--batch-size", str(a.batch_size), "--lr", str(a.lr)]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,  # Ctrl-C reaches us only; we clean up
        )
        peer = Peer(name, proc)
        peer.reader = threading.Thread(target=self._read, args=(peer,), daemon=True)
        peer.reader.start()
        self.peers.append(peer)
        return peer

    def _read(self, peer: Peer) -> None:
        assert peer.proc.stdout is not None
        for raw in peer.proc.stdout:
            line = raw.rstrip("\n")
            peer.lines.append(line)
            if ACCURACY.search(line):
                self.accuracy_line = line.strip()
            if self.args.verbose or any(s in line for s in INTERESTING):
                self.say(f"  {peer.name} | {line}")

    def members(self) -> list[Peer]:
        """Healthy peers that have joined the job (a peer still importing torch has not
        installed its SIGTERM handler yet: disturbing it tests nothing)."""
        joined = set(self.member_names.values())
        return [p for p in self.peers if p.healthy and p.name in joined]

    def act(self, kind: str) -> bool:
        """Carry out one action; False when it must wait (no member to act on yet)."""
        running = [p for p in self.peers if p.running]
        if kind != "add" and len([p for p in self.peers if p.healthy]) - 1 < self.args.min_np:
            self.say(f"{kind}: would leave fewer than min_np={self.args.min_np} peers; "
                     "adding one instead")
            kind = "add"
        if kind == "add" and len(running) >= self.args.max_peers:
            self.say(f"add: {len(running)} peers already running (--max-peers); skipped")
            return True
        if kind == "add":
            peer = self.spawn()
            self.record(kind, peer, f"started {peer.name} (pid {peer.pid})")
            return True
        members = self.members()
        if not members:
            return False
        peer = self.rng.choice(sorted(members, key=lambda p: p.name))
        if kind == "kill":
            peer.killed = True
            os.kill(peer.pid, signal.SIGKILL)
            self.record(kind, peer, f"SIGKILL {peer.name} (pid {peer.pid}): a crash")
        elif kind == "term":
            peer.leaving = True
            os.kill(peer.pid, signal.SIGTERM)
            self.record(kind, peer, f"SIGTERM {peer.name} (pid {peer.pid}): a graceful leave")
        elif kind == "stop":
            peer.cont_at = time.monotonic() + self.args.stop_s
            peer.stops += 1
            os.kill(peer.pid, signal.SIGSTOP)
            self.record(kind, peer, f"SIGSTOP {peer.name} (pid {peer.pid}) for "
                                    f"{self.args.stop_s:.1f} s (lease TTL {self.args.lease_ttl} s)")
        return True

    def record(self, kind: str, peer: Peer, msg: str) -> None:
        self.actions.append((time.monotonic() - self.t0, kind, peer.name))
        self.say(f"ACTION {msg}")

    def wake_stopped(self, now: float, force: bool = False) -> None:
        for p in self.peers:
            if p.cont_at is not None and (force or now >= p.cont_at):
                p.cont_at = None
                if p.running:
                    os.kill(p.pid, signal.SIGCONT)
                    self.say(f"ACTION SIGCONT {p.name} (pid {p.pid}): it wakes up past its "
                             "lease and must rejoin")

    def kill_all(self) -> None:
        for p in self.peers:
            if p.running:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)  # its own session: the peer and its children
                    except ProcessLookupError:
                        pass
        for p in self.peers:
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"{p.name} (pid {p.pid}) did not die")
            if p.reader is not None:
                p.reader.join(timeout=2)

    # --- watching the job -------------------------------------------------------------------

    def poll(self) -> None:
        """Read the job's status and event log; print what is new."""
        assert self.client is not None
        try:
            doc = job_status(self.client, self.job)
        except PeerElasticError:
            return  # no run yet (the first peer has not registered), or etcd hiccup
        for m in doc["members"]:
            for p in self.peers:
                if p.pid == m["pid"] and m["id"] not in self.member_names:
                    self.member_names[m["id"]] = p.name
        if doc["progress"] is not None and not self.training_started:
            self.training_started = True
            self.say(f"training: generation {doc['generation']}, world size {doc['world_size']}")
        try:
            kvs, _ = self.client.get_prefix(doc["keys_prefix"] + "events/")
        except PeerElasticError:
            kvs = []
        for kv in sorted(kvs, key=lambda kv: kv.key):
            if kv.key in self.seen_events:
                continue
            self.seen_events.add(kv.key)
            try:
                ev = decode(EventRecord, kv.value, kv.key)
            except RecordError:
                continue
            self.show_event(ev)
        if doc["done"] is not None and self.done is None:
            self.done = doc["done"]

    def show_event(self, ev: EventRecord) -> None:
        if ev.kind == "joined" and ev.member_id not in self.member_names:
            pid = re.search(r"\bpid (\d+)", ev.detail)
            for p in self.peers:
                if pid and p.pid == int(pid.group(1)):
                    self.member_names[ev.member_id] = p.name
        who = self.named(ev.member_id)
        if ev.kind == "generation":
            self.generations.append((ev.generation, ev.detail))
            label = "start" if ev.generation == 1 else "RESET"
            self.say(f"{label} -> generation {ev.generation}: {self.named(ev.detail)}")
        elif ev.kind == "generation formed":
            t = ev.timings_s
            took = ""
            if "total" in t:
                parts = [f"{k.replace('_to_', '->')} {t[k]:.2f}" for k in
                         ("detected_to_written", "written_to_formed", "formed_to_synced",
                          "synced_to_first_step") if k in t]
                took = f" in {t['total']:.2f} s ({', '.join(parts)})"
            self.say(f"  generation {ev.generation} formed{took}")
        elif ev.kind in ("joined", "left", "expired", "done", "blacklisted"):
            detail = f": {self.named(ev.detail)}" if ev.detail else ""
            self.say(f"  event {ev.kind} {who}{detail}")

    # --- the run ------------------------------------------------------------------------------

    def plan(self) -> list[tuple[float, str]]:
        """(delay after the previous action, kind): a crash first, then a seeded mix that
        holds every kind at least once."""
        a = self.args
        rest = ["term", "stop", "add"]
        rest += [self.rng.choice(ACTIONS) for _ in range(max(0, a.actions - 1 - len(rest)))]
        self.rng.shuffle(rest)
        kinds: list[str] = []
        healthy = a.np
        for kind in ["kill", *rest][: a.actions]:
            # Keep min_np peers: add one first when this action would go below. (A stopped
            # peer comes back as a new member later; counting it as gone is the safe side.)
            if kind != "add" and healthy - 1 < a.min_np:
                kinds.append("add")
                healthy += 1
            kinds.append(kind)
            healthy += 1 if kind == "add" else -1
        return [(self.rng.uniform(a.gap_s * 0.7, a.gap_s * 1.3), k) for k in kinds]

    def run(self) -> int:
        a = self.args
        self.server = EtcdServer().start()
        self.client = EtcdClient(self.server.endpoint)
        self.say(f"etcd at {self.server.endpoint}, job {self.job}")
        self.env = dict(os.environ)
        self.env.update({
            "PEER_ELASTIC_ETCD": self.server.endpoint,
            "PEER_ELASTIC_JOB": self.job,
            "PEER_ELASTIC_MIN_NP": str(a.min_np),
            "PEER_ELASTIC_LEASE_TTL": str(a.lease_ttl),
            "PEER_ELASTIC_START_SETTLE": "2.0",
            # A peer stuck in a collective with a stopped one gives up after this long.
            "PEER_ELASTIC_COLLECTIVE_TIMEOUT": str(a.collective_timeout),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        })
        for _ in range(a.np):
            self.spawn()
        self.say(f"started {a.np} peers of {TRAIN.name} --epochs {a.epochs} "
                 f"--batch-size {a.batch_size}: "
                 + ", ".join(f"{p.name} (pid {p.pid})" for p in self.peers))
        schedule = self.plan()
        self.say("schedule: " + ", ".join(f"+{d:.1f}s {k}" for d, k in schedule))
        deadline = self.t0 + a.duration
        next_at: float | None = None
        last_poll = 0.0
        finished_at: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                self.say(f"TIME LIMIT: --duration {a.duration:.0f} s reached")
                return 1
            self.wake_stopped(now)
            if now - last_poll >= 0.5:
                last_poll = now
                self.poll()
            if self.done is not None:
                # Training is over: wake anyone still stopped so it can see that and exit.
                self.wake_stopped(now, force=True)
                schedule.clear()
                finished_at = finished_at or now
            if self.training_started and schedule and self.done is None:
                if next_at is None:
                    next_at = now + schedule[0][0]
                if now >= next_at and self.act(schedule[0][1]):
                    schedule.pop(0)
                    next_at = now + schedule[0][0] if schedule else None
            if not any(p.running for p in self.peers):
                self.poll()
                return 0
            if finished_at is not None and now - finished_at > a.exit_grace_s:
                self.say(f"peers still running {a.exit_grace_s:.0f} s after the job finished: "
                         + ", ".join(p.name for p in self.peers if p.running))
                return 1
            time.sleep(0.1)

    def summary(self, rc: int) -> int:
        a = self.args
        took = time.monotonic() - self.t0
        print("\n=== summary ===", flush=True)
        print(f"seed {a.seed}, job {self.job}, {took:.1f} s")
        counts = {k: sum(1 for _, kind, _ in self.actions if kind == k) for k in ACTIONS}
        print("actions: " + ", ".join(f"{counts[k]} {k}" for k in ACTIONS))
        for t, kind, name in self.actions:
            print(f"  {t:6.1f}s {kind:<4} {name}")
        resets = [g for g in self.generations if g[0] > 1]
        print(f"resets: {len(resets)} (generations after the first)")
        for n, reason in resets:
            print(f"  generation {n}: {self.named(reason)}")
        unexpected = []
        for p in self.peers:
            code = p.proc.poll()
            how = ("killed by us" if p.killed else "left (SIGTERM)" if p.leaving
                   else f"stopped {p.stops}x" if p.stops else "")
            print(f"  {p.name} (pid {p.pid}): exit {code}" + (f", {how}" if how else ""))
            if not p.killed and code not in (0, None):
                unexpected.append(p)
        if rc == 130:
            unexpected = []  # we killed everyone on the way out
        for p in unexpected:
            print(f"--- {p.name} exited {p.proc.poll()} unexpectedly; its last lines:")
            print("\n".join(p.lines[-25:]))
        if self.accuracy_line:
            print(f"final: {self.accuracy_line}")
        ok = (rc == 0 and self.done is not None and bool(self.done.get("success"))
              and self.accuracy_line is not None and not unexpected)
        if rc == 130:
            print("result: INTERRUPTED")
        elif self.done is None:
            print("result: FAILED (the job did not finish)")
        elif not self.done.get("success"):
            print(f"result: FAILED (the job failed: {self.done.get('reason')})")
        elif not ok:
            print("result: FAILED (the job finished, but see above)")
        else:
            print("result: the job finished successfully")
        sys.stdout.flush()
        return 0 if ok else 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.kill_all()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="schedule seed (default: random)")
    ap.add_argument("--quick", action="store_true", help="a short run (about 20 s)")
    ap.add_argument("--np", type=int, default=3, help="peers to start (default 3)")
    ap.add_argument("--min-np", type=int, default=2, help="peers always kept (default 2)")
    ap.add_argument("--max-peers", type=int, default=4,
                    help="most peers running at once; `add` is skipped beyond (default 4)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs of train_digits.py (default 180, 40 with --quick)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="per-peer batch size of train_digits.py (default 8: many small "
                         "steps, so the disruptions land mid-epoch)")
    ap.add_argument("--lr", type=float, default=0.0125,
                    help="per-peer learning rate of train_digits.py (default 0.0125)")
    ap.add_argument("--actions", type=int, default=None,
                    help="number of disruptions (default 8, 4 with --quick)")
    ap.add_argument("--gap-s", type=float, default=None,
                    help="mean seconds between disruptions (default 5, 1.5 with --quick)")
    ap.add_argument("--lease-ttl", type=int, default=3, help="member lease TTL (default 3 s)")
    ap.add_argument("--stop-s", type=float, default=None,
                    help="how long `stop` keeps a peer stopped (default lease TTL + 2 s)")
    ap.add_argument("--collective-timeout", type=float, default=5.0,
                    help="PEER_ELASTIC_COLLECTIVE_TIMEOUT for the peers (default 5 s)")
    ap.add_argument("--duration", type=float, default=None,
                    help="hard limit on the whole demo (default 240 s, 120 s with --quick)")
    ap.add_argument("--exit-grace-s", type=float, default=30.0,
                    help="how long peers may take to exit after the job finished (default 30)")
    ap.add_argument("--verbose", "-v", action="store_true", help="echo all peer output")
    args = ap.parse_args(argv)
    quick = args.quick
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 1_000_000)
    if args.epochs is None:
        args.epochs = 40 if quick else 180
    if args.actions is None:
        args.actions = 4 if quick else 8
    if args.gap_s is None:
        args.gap_s = 1.5 if quick else 5.0
    if args.stop_s is None:
        args.stop_s = args.lease_ttl + 2.0
    if args.duration is None:
        args.duration = 120.0 if quick else 240.0
    if args.min_np < 1 or args.np < args.min_np or args.max_peers < args.np:
        ap.error("need 1 <= --min-np <= --np <= --max-peers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"chaos seed {args.seed} (replay the schedule with --seed {args.seed})", flush=True)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C and SIGTERM both end the demo cleanly (also when started with SIGINT ignored,
    # as background jobs of a non-interactive shell are).
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    chaos = Chaos(args)
    rc = 1
    try:
        rc = chaos.run()
    except KeyboardInterrupt:
        chaos.say("interrupted: killing every peer")
        chaos.close()
        chaos.summary(130)
        return 130
    finally:
        chaos.close()  # kills what is left, stops etcd
    return chaos.summary(rc)


if __name__ == "__main__":
    sys.exit(main())
