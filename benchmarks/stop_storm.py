"""Stop storm: SIGSTOP and SIGCONT peers of one job again and again, and catch a peer that
falls silent for good.

Three test-worker peers (tests/helpers/elastic_worker.py) train on one etcd started here;
every 0.5-3 s one of them, chosen at random, is stopped for 0.2-5 s (under and past
``join_timeout_s`` and the lease TTL). A peer that prints nothing for 25 s while this runs
is a freeze: its stacks are dumped with ``py-spy dump --native`` (when py-spy is installed)
and its output written to ``--log-dir``, and the run fails. This is how the GIL deadlock
of :mod:`peer_elastic.torch.gloo.retired_groups` was caught: with DDP rebuilt in the reset
callback and two busy loops on the 2 cores (``--hogs 2``), 2 of 3 runs of 280 s froze a
peer before the fix.

    python benchmarks/stop_storm.py --seconds 280 --ddp 1 --hogs 2 --runs 3

Exit status 0 when every run ended with all peers alive and talking.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer_elastic.etcd_server import EtcdServer  # noqa: E402
from tests.helpers.false_drops import start_hogs  # noqa: E402
from tests.helpers.procs import Cluster, PeerProc  # noqa: E402

SILENT_S = 25.0  # far past any hold below, and the 15 s stack trap of the worker
HOLDS_S = (0.2, 0.5, 0.8, 1.2, 2.0, 4.0, 5.0)


def dump_stacks(p: PeerProc) -> str:
    if shutil.which("py-spy") is None:
        return "(py-spy not installed: see the worker's own stack dump in its output)"
    out = subprocess.run(["py-spy", "dump", "--native", "--pid", str(p.pid)],
                         capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def storm(seed: int, seconds: float, ddp: bool, log_dir: Path) -> bool:
    rng = random.Random(seed)
    settings = dict(
        PEER_ELASTIC_LEASE_TTL=3, PEER_ELASTIC_JOIN_TIMEOUT=1.5, PEER_ELASTIC_START_SETTLE=1.0,
        PEER_ELASTIC_COLLECTIVE_TIMEOUT=20, PEER_ELASTIC_MIN_NP=1, PEER_ELASTIC_LOG_LEVEL="INFO",
        WORKER_SAMPLES=240, WORKER_STEP_S=0.01, WORKER_EPOCHS=3000, WORKER_DDP=int(ddp),
        WORKER_CHECK_EVERY=rng.choice([0, 1]), WORKER_COMMIT_EVERY=rng.choice([1, 2, 5]),
        WORKER_STACKS_AFTER_S=15)
    with EtcdServer(name=f"storm-{seed}") as server:
        cluster = Cluster(server.endpoint, f"storm-{seed}", **settings)
        peers = cluster.start(3)
        stops, last_seen = 0, {p.name: (0, time.monotonic()) for p in peers}
        try:
            for p in peers:
                p.wait_line("GEN", timeout=120)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                p = rng.choice(peers)
                os.kill(p.pid, signal.SIGSTOP)
                time.sleep(rng.choice(HOLDS_S))
                os.kill(p.pid, signal.SIGCONT)
                stops += 1
                time.sleep(rng.uniform(0.5, 3.0))
                now = time.monotonic()
                for q in peers:
                    if q.proc.poll() is not None:
                        print(f"STORM seed {seed}: {q.name} exited ({q.proc.returncode}) "
                              f"after {stops} stops:\n{q.output()}", flush=True)
                        return False
                    with q.cond:
                        lines = len(q.lines)
                    if lines != last_seen[q.name][0]:
                        last_seen[q.name] = (lines, now)
                    elif now - last_seen[q.name][1] > SILENT_S:
                        stacks = dump_stacks(q)
                        path = log_dir / f"storm-{seed}-{q.name}.log"
                        with q.cond:
                            path.write_text("\n".join(q.lines) + "\n\n" + stacks)
                        print(f"STORM seed {seed}: {q.name} (pid {q.pid}) silent for "
                              f"{SILENT_S:.0f} s after {stops} stops; output and stacks in "
                              f"{path}\n{stacks}", flush=True)
                        return False
            print(f"STORM seed {seed}: {stops} stops, every peer alive and talking",
                  flush=True)
            return True
        finally:
            cluster.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=280.0, help="length of each storm")
    ap.add_argument("--ddp", type=int, choices=(0, 1), default=1,
                    help="1: DDP rebuilt in the reset callback (default); 0: "
                         "DistributedOptimizer")
    ap.add_argument("--hogs", type=int, default=0, help="busy loops beside the peers")
    ap.add_argument("--log-dir", default=None, help="where a frozen peer's output goes")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**9)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-elastic-storm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    hogs = start_hogs(args.hogs)
    try:
        passed = [storm(seed + i, args.seconds, bool(args.ddp), log_dir)
                  for i in range(args.runs)]
    finally:
        for h in hogs:
            h.kill()
    print(f"STORM: {sum(passed)} of {len(passed)} runs passed (seeds {seed}.."
          f"{seed + args.runs - 1})", flush=True)
    return 0 if all(passed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
