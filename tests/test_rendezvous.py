"""A generation superseded while its process group is being formed (real etcd, real gloo).

Ranks publish their addresses in the store, then read each other's and connect. A rank
that gave up after publishing (its generation was superseded) used to leave the others
connecting to it inside gloo, where nothing interrupts them: five times the group timeout
on torch 2.13 (measured: 40 s at an 8 s timeout), or a group that formed without it and
stalled in its first collective. ``tests/helpers/group_proc.py`` makes that supersession
certain: one peer marks the generation broken right after writing its own address and
waits for the newer generation before reading its peers'. The commit point
(``peer_elastic/torch/barrier.py``) rules that out.

A member killed right after publishing its address strands the others the same way, and
no commit point helps there. Once its death supersedes the generation, each rank's
formation guard (``peer_elastic.torch.gloo.stranded_connect``) hands gloo's waiting pairs a
closed socket; as a backstop, groups form under a shorter timeout
(``GroupManager.init_timeout_s``), which bounds the wait at five times that.
"""

from __future__ import annotations

import re
import time

import pytest

from peer_elastic.etcd.coordinator import Assignment
from peer_elastic.torch.formed_group import FormedGroup
from peer_elastic.torch.group import GroupManager
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.fakes import FakeCoordinator
from tests.helpers.procs import Cluster, PeerProc
from tests.helpers.views import cfg

# Groups form under max(5, 4 x join timeout) s + 20 ms a rank = 5.06 s here, and then get
# this collective timeout. A rank stranded in gloo waits five times the former: 25 s.
COLLECTIVE_TIMEOUT_S = 20.0
SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 10,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1,
    "PEER_ELASTIC_START_SETTLE": 0.5,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": COLLECTIVE_TIMEOUT_S,
    "PEER_ELASTIC_MIN_NP": 1,
}
GROUP_PROC = "tests.helpers.group_proc"


cluster = cluster_fixture(SETTINGS)


def sums(p: PeerProc) -> dict[int, int]:
    """Generation -> the all-reduced sum this peer printed for it."""
    with p.cond:
        found = [re.fullmatch(r"SUM (\d+) (\d+)", line) for line in p.lines]
    return {int(m[1]): int(m[2]) for m in found if m}


def wait_all_sum(peers: list[PeerProc], total: int, after: int, timeout: float) -> int:
    """The first generation after ``after`` in which every peer all-reduced ``total``."""
    deadline = time.monotonic() + timeout
    while True:
        common = set.intersection(*({g for g, s in sums(p).items() if s == total and g > after}
                                    for p in peers))
        if common:
            return min(common)
        if time.monotonic() > deadline:
            raise AssertionError("no common generation with all-reduced sum "
                                 f"{total} after {after}:\n" +
                                 "\n".join(f"--- {p.name}\n{p.output()}" for p in peers))
        with peers[0].cond:  # woken by any line of the first peer; others are polled
            peers[0].cond.wait(0.1)


@pytest.mark.slow
def test_supersession_during_the_rendezvous_strands_nobody(cluster: Cluster) -> None:
    a, b = cluster.start(2, module=GROUP_PROC)
    first = wait_all_sum([a, b], 2, after=0, timeout=90)
    # c joins; its first three rendezvous are superseded after it wrote its address. Before
    # the commit point, each one stranded a rank or broke the group about 2 times in 3.
    rounds = 3
    (c,) = cluster.start(1, module=GROUP_PROC, GROUP_PROC_SUPERSEDE=rounds)
    line = c.wait_line("SUPERSEDED", timeout=90)
    t0 = time.monotonic()
    superseded = int(line.split()[1])
    for _ in range(rounds - 1):
        line = c.wait_line("SUPERSEDED", after=c.lines.index(line) + 1, timeout=60)
    last = int(line.split()[1])
    final = wait_all_sum([a, b, c], 3, after=last - 1, timeout=90)  # the last one formed too
    took = time.monotonic() - t0
    print(f"generation {superseded} superseded mid-rendezvous ({rounds} rounds); all three "
          f"all-reduced in generation {final} {took:.1f} s later")
    assert final > first
    # A stranded rank waits out gloo's connect timeouts: 25 s each time.
    assert took < COLLECTIVE_TIMEOUT_S, took
    for p in (a, b, c):
        assert "BROKEN" not in p.output(), p.output()
        # Formed under a shorter timeout, every group has the collective timeout afterwards.
        with p.cond:
            timeouts = {line.split()[2] for line in p.lines if line.startswith("TIMEOUT ")}
        assert timeouts == {f"{COLLECTIVE_TIMEOUT_S:g}"}, p.output()


@pytest.mark.slow
def test_a_member_killed_while_the_others_connect_to_it_costs_no_group_timeouts(
        etcd: str, unique_job: str) -> None:
    # The default group timeout (30 s): waiting it out five times over (150 s) is what the
    # short formation timeout rules out (5.06 s here: a 25 s wait); the formation guard frees
    # the ranks once the kill supersedes the generation (about 2 s).
    cluster = Cluster(etcd, unique_job, **{**SETTINGS, "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 30})
    try:
        a, b = cluster.start(2, module=GROUP_PROC)
        first = wait_all_sum([a, b], 2, after=0, timeout=90)
        (c,) = cluster.start(1, module=GROUP_PROC, GROUP_PROC_DIE_IN_RENDEZVOUS=1)
        line = c.wait_line("DYING", timeout=90)
        t0 = time.monotonic()
        assert c.wait(30) == -9
        final = wait_all_sum([a, b], 2, after=int(line.split()[1]), timeout=120)
        took = time.monotonic() - t0
        print(f"c died in generation {line.split()[1]}'s rendezvous; a and b all-reduced "
              f"in generation {final} {took:.1f} s later")
        assert final > first
        assert took < 8, f"{took:.1f} s: the guard did not free the ranks (gloo alone: 25 s)"
    finally:
        cluster.close()


@pytest.mark.parametrize(("join_timeout_s", "collective_timeout_s", "size", "expected"), [
    (1.0, 30.0, 50, 6.0),  # the defaults: at least 5 s, plus 20 ms a rank
    (3.0, 30.0, 100, 14.0),  # four join timeouts, plus 20 ms a rank
    (3.0, 8.0, 2, 8.0),  # never longer than the collective timeout
])
def test_groups_form_under_a_shorter_timeout_than_their_collectives(
        join_timeout_s: float, collective_timeout_s: float, size: int, expected: float) -> None:
    coordinator = FakeCoordinator(cfg(join_timeout_s=join_timeout_s))
    groups = GroupManager(coordinator, "gloo", collective_timeout_s)
    assert groups.init_timeout_s(size) == pytest.approx(expected)
    groups.close()


def test_a_peer_that_lost_its_lease_registers_again_only_after_leaving_its_group() -> None:
    # The coordinator asks the gate before re-registering (Coordinator.hold_rejoin). A
    # training thread still in a group of the lost registration (gloo can keep a queued send
    # there until the group's timeout) must not be listed again: the others would wait for it.
    coordinator = FakeCoordinator(cfg(join_timeout_s=1.0), incarnation=1)
    groups = GroupManager(coordinator, "gloo", 30.0)
    assert coordinator.rejoin_gate == groups.left_lost_registration
    assert groups.left_lost_registration()  # a standby, or between groups
    a = Assignment(generation=3, rank=0, size=2, roster=("m", "n"), joined=False, reason="")
    groups.current = FormedGroup(a, "gloo", 0.0, 0.0, 0.0, incarnation=1)
    assert groups.left_lost_registration()  # its group belongs to the live registration
    coordinator.incarnation = 2  # the lease is lost
    assert not groups.left_lost_registration()
    groups.destroy()  # the training thread left the group: the coordinator is woken
    assert groups.left_lost_registration() and coordinator.view.wakes
    groups.close()
    assert coordinator.rejoin_gate is None  # a closed manager holds nothing back
