"""A crashed peer is dropped on evidence (its probe port refuses), not after join_timeout.

Real etcd, real peer processes (tests/helpers/elastic_worker.py). ``join_timeout_s`` and the
lease TTL are 45 s here, so the only way to re-form within a few seconds is a confirmed
death (peer_elastic/etcd/deaths.py). A stopped peer (SIGSTOP, shorter than join_timeout)
still accepts connections: it must not be dropped. Every test ends with the exactly-once
oracle.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.view import JobView
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.false_drops import run_resets
from tests.helpers.netns import tcp_connections
from tests.helpers.procs import Cluster, PeerProc, gone
from tests.helpers.worker_lines import (
    GEN_LINE,
    gen_lines,
    member_of,
    result_of,
    results,
    start_world_of_3,
    wait_more_steps,
    wait_world,
)

pytestmark = pytest.mark.slow

SLOW = 45  # join_timeout_s and the lease TTL: far beyond what a confirmed death may take
FAST = 20.0  # re-formed within this (a confirmed death takes well under 1 s; a loaded machine)
SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": SLOW,
    "PEER_ELASTIC_JOIN_TIMEOUT": SLOW,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 60,
    "PEER_ELASTIC_MIN_NP": 1,
    "WORKER_SAMPLES": 960,
    "WORKER_STEP_S": 0.03,
    "WORKER_EPOCHS": 40,
}


cluster = cluster_fixture(SETTINGS)


def test_killed_member_and_killed_leader_are_dropped_long_before_join_timeout(
        cluster: Cluster, tmp_path) -> None:
    end = tmp_path / "end"
    a, b, c = start_world_of_3(*cluster.start(3, WORKER_END_FILE=end))
    c.signal(signal.SIGKILL)  # a non-leader
    took = wait_world(a, 2, SLOW)
    assert took < FAST, f"world of 2 after {took:.1f} s: the death was not confirmed"
    wait_more_steps(b, 3)
    a.signal(signal.SIGKILL)  # the leader (the oldest member, rank 0)
    took = wait_world(b, 1, SLOW)
    assert took < FAST, f"world of 1 after {took:.1f} s: the leader's death was not confirmed"
    wait_more_steps(b, 3)
    end.touch()
    assert b.wait(180) == 0, b.output()
    r = result_of(b)
    assert r["exact"] and r["identical"] and r["world"] == 1, r
    assert "confirmed dead: connection refused" in b.output() or \
        "confirmed dead: connection refused" in a.output(), "the drop must name its evidence"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a peer's DataLoader workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def forked_in_world(p: PeerProc, size: int) -> None:
    """Wait for ``p``'s FORKED line of its latest entry in a world of ``size`` (under load
    it may have trained in smaller worlds first, with children of their own)."""
    with p.cond:
        at = max(i for i, line in enumerate(p.lines)
                 if (m := GEN_LINE.fullmatch(line)) and int(m[3]) == size)
    p.wait_line("FORKED", after=at)


def gloo_connections_of(pids: list[int], cluster: Cluster) -> dict[int, list]:
    """The TCP connections each of ``pids`` holds, (local ip, port, remote ip, port), but
    those to etcd (a forked child keeps its parent's etcd client's, unused: gRPC's fork
    support is off). A process gone meanwhile holds none."""
    etcd_ports = {int(e.rsplit(":", 1)[1]) for e in cluster.env["PEER_ELASTIC_ETCD"].split(",")}
    found = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if held := [c for c in tcp_connections(pid) if c[3] not in etcd_ports]:
                found[pid] = held
    return found


def test_forked_children_keep_neither_a_dead_peer_alive_nor_a_live_one_from_its_job(
        cluster: Cluster, tmp_path) -> None:
    """Processes a peer forks mid-run hold a copy of every descriptor. DataLoader workers
    stalled in their dataset outlive a SIGKILLed peer: its gloo connections and probe
    listener must still close with it (peer_elastic.process.parent_only_sockets). With the workers
    holding them the others got no reset and no refused probe, and waited for its lease
    (SLOW here; 4.3 s instead of 0.12 s where the workers' 5 s parent check ended them).
    A program it runs with the descriptors it may inherit (``os.system``) must not hold its
    gloo connections either, those of the subgroup its training function made included:
    gloo opens them inheritable (peer_elastic.process.sockets.keep_from_exec); the others
    then waited out the grace after the confirmed death.
    Then each survivor re-enters its training function and stops the helper process it
    forked (``terminate()``): that SIGTERM must end the helper, not reach the peer through
    the handler the helper inherited (peer_elastic.process.signal_relay): the peer left the job, and
    the helper lived on.
    """
    end, hold = tmp_path / "end", tmp_path / "hold"
    a, b, c = start_world_of_3(*cluster.start(
        3, WORKER_END_FILE=end, WORKER_LOADER_WORKERS=1, WORKER_LOADER_HOLD=hold,
        WORKER_FORKED_HELPER=1, WORKER_EXEC_CHILD=1,
        # DDP over a subgroup the training function makes: the survivors wait in it.
        WORKER_DDP=1, WORKER_DDP_SUBGROUP="train"))
    forked_in_world(c, 3)
    dead_peers_children = children(c.pid)
    try:
        assert len(dead_peers_children) >= 3, f"c forked no children:\n{c.output()}"
        # None of c's children holds a connection of its groups (the survivors would wait
        # in a collective for a peer that is gone): the hook took them from the forked ones,
        # close-on-exec from the program.
        held = gloo_connections_of(dead_peers_children, cluster)
        assert not held, f"c's children hold its connections (pid: [(local, remote)]): {held}"
        c.signal(signal.SIGKILL)
        took = wait_world(a, 2, SLOW)
        # The helper dies with c (a parent-death signal); the stalled worker and the
        # waiting program outlive it.
        assert sum(not gone(w) for w in dead_peers_children) >= 2, "c's children must live on"
        assert took < FAST, f"world of 2 after {took:.1f} s: the death was not confirmed"
        for p in (a, b):  # re-entered: each stopped its first helper
            line = p.wait_line("HELPER", timeout=90)
            assert line.endswith(" ended"), f"{p.name}: {line}\n{p.output()}"
        wait_more_steps(a, 3)
        wait_more_steps(b, 3)
    finally:
        hold.touch()
        for w in dead_peers_children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
    end.touch()
    for p in (a, b):
        assert p.wait(180) == 0, p.output()
    (r,) = results([a, b])
    assert r["exact"] and r["identical"] and r["world"] == 2, r


def test_a_dead_peer_s_connections_held_open_by_its_program_do_not_hold_the_others(
        cluster: Cluster, tmp_path) -> None:
    """A program a peer starts between a subgroup's creation and its next check (or from C,
    out of Python's reach) inherits the subgroup's connections, gloo opening them
    inheritable. When the peer dies they stay open: no collective fails, every ack was
    given, so nothing but the lease (45 s here) ended the survivors' wait. A collective
    that waits makes each rank probe its group (Reachability.waited_on_peers): the refused
    probe marks the generation broken, the leader confirms the death, and the watchdog
    abandons the group within half a second, not a join timeout (GroupManager.lost_peer)."""
    end, hold, hang = tmp_path / "end", tmp_path / "hold", tmp_path / "hang"
    a, b, c = start_world_of_3(*cluster.start(
        3, WORKER_END_FILE=end, WORKER_LOADER_HOLD=hold, WORKER_EXEC_CHILD="early",
        WORKER_DDP=1, WORKER_DDP_SUBGROUP="train", WORKER_HANG_FILE=hang,
        PEER_ELASTIC_LOG_LEVEL="INFO"))
    forked_in_world(c, 3)
    programs = children(c.pid)
    try:
        held = gloo_connections_of(programs, cluster)
        assert held, f"c's program inherited no connection: nothing is tested\n{c.output()}"
        # c stops before its next step: a and b go on into that step's DDP all-reduce, over
        # the subgroup whose connections the program holds, and wait there for c.
        hang.write_text(f"{c.pid}\n")
        c.wait_line("HANGING")
        c.signal(signal.SIGKILL)
        took = wait_world(a, 2, SLOW)
        assert held.keys() <= {p for p in programs if not gone(p)}, "the program must live on"
        assert took < FAST, f"world of 2 after {took:.1f} s: the held connections stalled it"
        wait_more_steps(a, 3)
        wait_more_steps(b, 3)
    finally:
        hold.touch()
    end.touch()
    for p in (a, b):
        assert p.wait(180) == 0, p.output()
    (r,) = results([a, b])
    assert r["exact"] and r["identical"] and r["world"] == 2, r
    assert "probe refused" in a.output() + b.output(), "the break must name its evidence"


def test_a_stopped_member_is_not_taken_for_dead(etcd: str, unique_job: str, tmp_path) -> None:
    # c is killed; as soon as the break shows, b is stopped: from then on b owes its acks
    # just like c, but only c refuses connections (a stopped process's kernel still
    # accepts). The generations that answer the break drop c at once and keep b, which
    # trains in them once it is continued. (Stopped *before* the break, b would hold the
    # others inside their collective with it, and only the collective timeout would tell.)
    end = tmp_path / "end"
    cluster = Cluster(etcd, unique_job, **SETTINGS, PEER_ELASTIC_LOG_LEVEL="INFO")
    client = EtcdClient(etcd)
    view = JobView(client, unique_job).start()
    try:
        a, b, c = start_world_of_3(*cluster.start(3, WORKER_END_FILE=end))  # a leads
        gen = max(g for g, _, _ in gen_lines(a))
        ids = {"b": member_of(b), "c": member_of(c)}
        c.signal(signal.SIGKILL)
        assert view.wait_for(lambda v: bool(v.broken.get(gen)), FAST) is not None
        b.signal(signal.SIGSTOP)
        try:
            nxt = view.wait_for(lambda v: v.generation_number > gen
                                and ids["c"] not in v.generation.roster, FAST)
        finally:
            b.signal(signal.SIGCONT)
        assert nxt is not None, f"c was not dropped in time:\n{a.output()}"
        assert ids["b"] in nxt.generation.roster, "a stopped member was taken for dead"
        wait_world(a, 2, SLOW, seen=0)
        wait_world(b, 2, SLOW, seen=0)
        wait_more_steps(a, 3)
        end.touch()
        for p in (a, b):
            assert p.wait(180) == 0, p.output()
        (r,) = results([a, b])  # rank 0 prints it
        assert r["exact"] and r["identical"] and r["world"] == 2, r
        for p in (a, b):
            assert not [line for line in p.output().splitlines()
                        if "confirmed dead" in line and ids["b"] in line], p.output()
    finally:
        cluster.close()
        view.stop()
        client.close()


@pytest.mark.alone  # its own busy loops load both CPUs: no other test beside them
def test_crash_resets_under_cpu_load_drop_no_healthy_member(etcd: str, unique_job: str,
                                                            tmp_path) -> None:
    # The load test, short: two busy loops on the CPUs, a peer crashed and restarted
    # a few times at default settings; benchmarks/bench_false_drops.py runs 200 rounds.
    report = run_resets(etcd, unique_job, resets=2, end_file=tmp_path / "end")
    assert report.resets == 2 and report.false_drops == 0, report
    assert report.exact and not report.notes, report
