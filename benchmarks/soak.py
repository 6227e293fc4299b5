"""Chaos soak: the seeded chaos run of tests/test_chaos.py, longer and without pytest.

Starts a 3-member etcd cluster, runs 4 elastic_worker peers plus a standby under a seeded
schedule of ``--events`` events (SIGKILL, SIGTERM, new peer, SIGSTOP past the lease TTL,
etcd member and full etcd restarts), then checks the exactly-once oracle, exit codes and that
no peer process is left. ``--runs K`` repeats with seeds ``seed, seed+1, ...``. Exit code 0
when every run passed; the failing seeds are printed for replay.

    python benchmarks/soak.py --events 200                # one long run, random seed
    python benchmarks/soak.py --events 30 --runs 5        # five normal-size runs
    python benchmarks/soak.py --seed 1234 --events 30     # replay a seed
    PEER_ELASTIC_CHAOS_EVENTS=200 python -m pytest tests/test_chaos.py -s   # the same, in pytest
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer_elastic.etcd_server import EtcdCluster  # noqa: E402
from tests.helpers.chaos import ChaosFailure, events_from_env, run_chaos, seed_from_env  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None,
                    help="first seed (default: $PEER_ELASTIC_CHAOS_SEED, else random)")
    ap.add_argument("--events", type=int, default=None,
                    help="events per run (default: $PEER_ELASTIC_CHAOS_EVENTS, else 200)")
    ap.add_argument("--runs", type=int, default=1, help="runs, seeds seed..seed+runs-1")
    ap.add_argument("--log-dir", default=None,
                    help="where each run's peer and etcd logs go (default: a temp dir)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else seed_from_env()
    events = args.events if args.events is not None else events_from_env(default=200)
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-elastic-soak-"))
    failed: list[int] = []
    for run in range(args.runs):
        s = seed + run
        t0 = time.monotonic()
        with EtcdCluster(3) as etcd:
            try:
                _, result, problems = run_chaos(etcd, f"soak-{s}", s, events,
                                                log_dir=log_root / f"chaos-{s}")
            except ChaosFailure as exc:
                result, problems = {}, [str(exc)]
        verdict = "PASSED" if not problems else "FAILED"
        print(f"SOAK run {run + 1}/{args.runs} seed {s}: {verdict} in "
              f"{time.monotonic() - t0:.0f}s; result {result}", flush=True)
        for p in problems:
            print(p, flush=True)
        if problems:
            failed.append(s)
    print(f"SOAK {args.runs - len(failed)}/{args.runs} passed"
          + (f"; replay the failures with --seed {' / '.join(map(str, failed))} "
             f"--events {events}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
