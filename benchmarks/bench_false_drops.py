"""False drops under load: crash-and-restart resets with busy loops on every CPU.

A 3-peer job (tests/helpers/elastic_worker.py, every timing setting at its default, min_np=2)
trains while ``--hogs`` busy-loop processes compete for the CPUs. Each round SIGKILLs the
youngest peer once it trains in a world of 3 (a reset whose dead member is confirmed by a
refused probe, peer_elastic/etcd/deaths.py), waits for the world of 2, and starts it again.
Counted: healthy members dropped (a lost lease in a healthy peer's log, or a world below 2),
which must be 0; the kill -> world-of-2 times; and the exactly-once oracle at the end.

With ``--mode resize`` the resets come from ``max_np`` going 3 -> 2 -> 3 ... instead (the
youngest peer is parked and brought back; nothing restarts, every member stays healthy, so
any drop is false), which fits the issue's 200 resets in minutes.

Usage::

    python benchmarks/bench_false_drops.py --resets 200 --hogs 2 --mode resize --out drops.json
    python benchmarks/bench_false_drops.py --resets 20 --hogs 2 --out crash-drops.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer_elastic.testing import EtcdTestServer  # noqa: E402
from tests.helpers.false_drops import run_resets, run_resizes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resets", type=int, default=200, help="crash-and-restart rounds (200)")
    ap.add_argument("--hogs", type=int, default=2, help="busy-loop processes (2)")
    ap.add_argument("--mode", choices=("crash", "resize"), default="crash",
                    help="crash: SIGKILL and restart a peer per reset (a confirmed death; "
                         "20-30 s a round under the hogs); resize: max_np 3 -> 2 -> 3 ... "
                         "with every peer staying up (seconds a reset)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    print(f"load before: {os.getloadavg()}", flush=True)
    t0 = time.monotonic()
    with EtcdTestServer(name="false-drops") as server, tempfile.TemporaryDirectory() as tmp:
        run = run_resizes if args.mode == "resize" else run_resets
        report = run(server.client_url.split("://", 1)[1], f"false-drops-{os.getpid()}",
                     args.resets, Path(tmp) / "end", hogs=args.hogs,
                     say=lambda s: print(s, flush=True))
    rec = sorted(report.recovery_s)
    summary = {
        **asdict(report), "seconds": round(time.monotonic() - t0, 1),
        "load_after": os.getloadavg(),
        "recovery_median_s": statistics.median(rec) if rec else None,
        "recovery_p95_s": rec[int(0.95 * (len(rec) - 1))] if rec else None,
        "recovery_max_s": rec[-1] if rec else None,
    }
    summary.pop("recovery_s")
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "recovery_s": report.recovery_s}))
    return 0 if report.false_drops == 0 and report.exact and not report.notes else 1


if __name__ == "__main__":
    raise SystemExit(main())
