"""Chaos soak: the seeded chaos run of tests/test_chaos.py, longer and without pytest.

Starts a 3-member etcd cluster, runs 4 elastic_worker peers plus a standby under a seeded
schedule of ``--events`` events (SIGKILL, SIGTERM, new peer, SIGSTOP past the lease TTL,
etcd member and full etcd restarts), then checks the exactly-once oracle, exit codes and that
no peer process is left. ``--runs K`` repeats with seeds ``seed, seed+1, ...``. Exit code 0
when every run passed; the failing seeds are printed for replay.

    python benchmarks/soak.py --events 200                # one long run, random seed
    python benchmarks/soak.py --events 30 --runs 5        # five normal-size runs
    python benchmarks/soak.py --seed 1234 --events 30     # replay a seed
    PEER_ELASTIC_CHAOS_EVENTS=200 python -m pytest tests/test_chaos.py -n 0 -s   # the same, in pytest

``--schedules`` soaks the model-based schedules of tests/test_schedules.py instead (a seeded
API pattern plus events, tests/helpers/schedules.py), many seeds in a row; each run's verdict
is PASSED or FAILED, with the seed to replay it:

    python benchmarks/soak.py --schedules --runs 20 [--events 8] [--seed N] [--hosts 3]
    PEER_ELASTIC_SCHEDULE_SEED=N python -m pytest tests/test_schedules.py -n 0 -s   # replay one
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer_elastic.testing import EtcdCluster  # noqa: E402
from tests.helpers.chaos import ChaosFailure, events_from_env, run_chaos, seed_from_env  # noqa: E402
from tests.helpers.hosts import Hosts  # noqa: E402
from tests.helpers.schedules import fresh_seeds, make_plan, run_plan  # noqa: E402


def soak_schedules(seed: int, runs: int, events: int, log_root: Path,
                   hosts: Hosts | None = None) -> int:
    """``runs`` schedules with seeds seed..seed+runs-1 (the peers spread over ``hosts``
    when given); 1 when any failed."""
    verdicts: dict[str, list[int]] = {"PASSED": [], "FAILED": []}
    bridge = [hosts.bridge_ip4] if hosts is not None else []
    for run in range(runs):
        s = seed + run
        t0 = time.monotonic()
        plan = make_plan(s, events)
        with EtcdCluster(3, extra_client_hosts=bridge) as etcd:
            oc = run_plan(etcd, f"soak-sched-{s}", plan, log_root / f"work-{s}",
                          log_dir=log_root / f"schedule-{s}", hosts=hosts)
        verdict = "PASSED" if oc.passed else "FAILED"
        verdicts[verdict].append(s)
        print(f"SOAK schedule {run + 1}/{runs} seed {s}: {verdict} in "
              f"{time.monotonic() - t0:.0f}s [{plan.pattern.describe()}]", flush=True)
        if not oc.passed:
            print(oc.report(), flush=True)
    print(f"SOAK schedules: {len(verdicts['PASSED'])} passed, {len(verdicts['FAILED'])} "
          f"failed {verdicts['FAILED']}; replay one with PEER_ELASTIC_SCHEDULE_SEED=<seed> "
          f"PEER_ELASTIC_SCHEDULE_EVENTS={events} pytest tests/test_schedules.py -n 0 -s"
          + (" -k several_hosts" if hosts is not None else ""), flush=True)
    return 1 if verdicts["FAILED"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None,
                    help="first seed (default: $PEER_ELASTIC_CHAOS_SEED, else random)")
    ap.add_argument("--events", type=int, default=None,
                    help="events per run (default: $PEER_ELASTIC_CHAOS_EVENTS, else 200)")
    ap.add_argument("--runs", type=int, default=1, help="runs, seeds seed..seed+runs-1")
    ap.add_argument("--log-dir", default=None,
                    help="where each run's peer and etcd logs go (default: a temp dir)")
    ap.add_argument("--schedules", action="store_true",
                    help="soak the model-based schedules (tests/test_schedules.py) instead "
                         "(default events 8)")
    ap.add_argument("--hosts", type=int, default=0,
                    help="with --schedules: spread the peers over this many hosts (network "
                         "namespaces, tests/helpers/hosts.py; needs root)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else seed_from_env()
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-elastic-soak-"))
    if args.schedules:
        if args.seed is None:
            seed = fresh_seeds(1)[0]  # $PEER_ELASTIC_SCHEDULE_SEED, else random
        if not args.hosts:
            return soak_schedules(seed, args.runs, args.events or 8, log_root)
        with Hosts(args.hosts) as hosts:
            return soak_schedules(seed, args.runs, args.events or 8, log_root, hosts)
    events = args.events if args.events is not None else events_from_env(default=200)
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
