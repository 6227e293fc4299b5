"""Model-based schedules (issue 9): a seeded API pattern plus a seeded sequence of events on
a real job (real etcd cluster, real peer processes, real gloo groups), ending with the
exactly-once oracle, a digest comparison across ranks, exit codes and no process left.

Every run draws fresh seeds (printed as ``SCHEDULE SEED <seed>``, and in the test id).

    python -m pytest tests/test_schedules.py -n 0 -s                                  # fresh seeds
    PEER_ELASTIC_SCHEDULE_SEED=123 python -m pytest tests/test_schedules.py -n 0 -s   # replay one
    PEER_ELASTIC_SCHEDULE_EVENTS=20 ...                                                # longer ones
    python benchmarks/soak.py --schedules --runs 20                                    # soak many
    python benchmarks/soak.py --schedules --runs 20 --hosts 3                          # on 3 hosts

``test_schedule_exactly_once_on_several_hosts`` runs one more fresh seed with the peers spread
over three hosts (network namespaces, tests/helpers/hosts.py; needs root, else skipped),
where a stop of a peer alone on its host cuts that host off instead.

Generator and runner: tests/helpers/schedules.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from peer_elastic.testing import EtcdCluster
from tests.helpers.hosts import Hosts, hosts_or_skip
from tests.helpers.schedules import (
    LEASE_TTL_S,
    LONG_OUTAGE_HOLD_S,
    SHAPES,
    events_from_env,
    fresh_seeds,
    hang_detection,
    make_plan,
    run_plan,
)

SEEDS = fresh_seeds(1, "local")
HOST_SEEDS = fresh_seeds(1, "hosts")
N_EVENTS = events_from_env(6)


@pytest.mark.parametrize("seed", range(200))
def test_plans_are_seeded_and_keep_the_model(seed: int) -> None:
    plan = make_plan(seed, N_EVENTS)
    assert plan == make_plan(seed, N_EVENTS)  # a pure function of the seed
    assert len(plan.events) >= N_EVENTS
    live, mx, mn, paused = plan.peers, plan.max_np, plan.min_np, False
    for e in plan.events:
        if e.kind in ("kill", "term", "drain", "hang", "stop") or e.kill_during:
            assert not paused and min(live - 1, mx) >= mn, (seed, e)
            live -= e.kind != "stop"
        elif e.kind == "add":
            live += 1
            assert live <= plan.peers, (seed, e)
        elif e.kind == "set_max":
            mx = e.value
        elif e.kind == "set_min":
            mn = e.value
        elif e.kind in ("pause", "resume"):
            paused = e.kind == "pause"
        assert 1 <= mn <= mx and min(live, mx) >= mn, (seed, e, live, mx, mn)
        if e.kind == "stop":
            assert e.hold_s > 3.0 + 1.0  # past the join timeout and the lease TTL
        if e.kill_during:
            assert e.kind == "etcd_all", (seed, e)
        if e.kind == "etcd_all":  # up to a TTL and a second, or a long outage
            assert 0.5 <= e.hold_s <= LEASE_TTL_S + 1.0 or (
                LONG_OUTAGE_HOLD_S[0] <= e.hold_s <= LONG_OUTAGE_HOLD_S[1]), (seed, e)
        if e.kind == "stop_short":
            assert e.hold_s < 1.5  # under the join timeout
        if e.kind == "stop_mid":
            assert 1.5 < e.hold_s < 3.0  # past the join timeout, under the lease TTL
        if e.kind == "hang":
            assert hang_detection() is not None
        if e.kind == "restart":  # only where there is a snapshot to resume from
            assert plan.pattern.snapshots and not paused, (seed, e)
            if e.variant == "park":  # a roster of two at least, which may lose one
                assert min(live, mx) >= 2 and min(live, mx) - 1 >= mn, (seed, e)
    assert (mx, mn, paused) == (plan.max_np, plan.min_np, False)


def test_plans_cover_every_kind_and_pattern() -> None:
    kinds: Counter[str] = Counter()
    patterns: Counter[str] = Counter()
    for seed in range(300):
        plan = make_plan(seed, N_EVENTS)
        kinds.update(e.kind for e in plan.events)
        kinds.update(f"kill:{e.target}" for e in plan.events if e.kind == "kill")
        kinds.update("burst" for e in plan.events if e.burst)
        kinds.update("peers_only" for e in plan.events if e.peers_only)
        kinds.update("kill_during" for e in plan.events if e.kill_during)
        kinds.update(f"restart:{e.variant}" for e in plan.events if e.kind == "restart")
        kinds.update("long_outage" for e in plan.events
                     if e.kind == "etcd_all" and e.hold_s >= LONG_OUTAGE_HOLD_S[0])
        kinds.update([f"shape={(plan.peers, plan.min_np, plan.max_np)}"])
        patterns.update([f"record={plan.pattern.record}", f"check={plan.pattern.check_every}",
                         f"commit={plan.pattern.commit_every}", f"plain={plan.pattern.plain}",
                         f"ddp={plan.pattern.ddp}", f"snapshots={plan.pattern.snapshots}",
                         f"ddp_hook={plan.pattern.ddp_hook}", f"forks={plan.pattern.forks}",
                         f"sharded={plan.pattern.sharded}"])
    want = {"kill", "kill:leader", "kill:", "term", "drain", "add", "set_max", "set_min", "pause",
            "resume", "stop_short", "stop", "etcd_member", "etcd_all", "burst", "peers_only",
            "restart", "stop_mid", "kill_during", "long_outage", "restart:park",
            "restart:lower", "restart:slow", "restart:"}
    want |= {f"shape={shape}" for shape in SHAPES}
    if hang_detection() is not None:
        want.add("hang")
    assert want <= set(kinds), kinds
    assert {"record=batch", "record=indices", "record=local", "check=1", "commit=5",
            "plain=True", "ddp=True", "snapshots=True", "ddp_hook=True",
            "forks=True", "sharded=fsdp", "sharded=hsdp:2"} <= set(patterns), patterns


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_schedule_exactly_once(seed: int, etcd_cluster: EtcdCluster, unique_job: str,
                               tmp_path: Path,
                               record_property: Callable[[str, object], None]) -> None:
    record_property("schedule_seed", seed)
    plan = make_plan(seed, N_EVENTS)
    oc = run_plan(etcd_cluster, unique_job, plan, tmp_path / "work",
                  log_dir=tmp_path / f"schedule-{seed}")
    print(oc.report())
    if not oc.passed:
        pytest.fail(oc.report(), pytrace=False)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(3, "several hosts") as hs:
        yield hs


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", HOST_SEEDS, ids=[f"seed{s}" for s in HOST_SEEDS])
def test_schedule_exactly_once_on_several_hosts(seed: int, hosts: Hosts, unique_job: str,
                                                tmp_path: Path,
                                                record_property: Callable[[str, object], None]
                                                ) -> None:
    # The same generated plans, with the peers spread over three hosts (network namespaces
    # with their own addresses and hostnames, tests/helpers/hosts.py; etcd on their
    # bridge): group addresses, crash evidence and abandoned collectives go between hosts.
    record_property("schedule_seed", seed)
    plan = make_plan(seed, N_EVENTS)
    etcd = EtcdCluster(3, extra_client_hosts=[hosts.bridge_ip4]).start()
    try:
        oc = run_plan(etcd, unique_job, plan, tmp_path / "work", hosts=hosts,
                      log_dir=tmp_path / f"schedule-{seed}")
    finally:
        etcd.stop()
    print(oc.report())
    if not oc.passed:
        pytest.fail(oc.report(), pytrace=False)
    # Each peer registered from the host it was placed on (a member id begins with the
    # hostname its process saw), and the job spanned every host its first peers were placed
    # on (round robin: a two-peer shape starts on two of the three).
    placed = {m: p.proc.name.split("@")[1] for p in oc.runner.peers for m in p.members}
    assert all(m.startswith(f"{host}-") for m, host in placed.items()), placed
    assert len(set(placed.values())) >= min(len(hosts.hosts), plan.peers), placed
