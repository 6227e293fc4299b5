"""Snapshots and the state held in memory, at the edges: real etcd, real peer processes.

* A peer parked by ``set max_np`` keeps an old version of the state in memory while the
  others train on and write snapshots. When the others are then all lost, the parked peer
  must go on from the newest snapshot, not from what it held (a silent rollback).
* A job name reused by a run with another model starts a new lineage: its snapshots are
  kept although they count fewer commits than the old run's, and a restart resumes them.
* A resume whose load takes longer than ``collective_timeout_s`` still finishes: the
  waiting ranks wait in rounds, not in one collective.

Each ends with the exactly-once oracle (tests/helpers/elastic_worker.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import JobKeys
from tests.helpers.procs import Cluster, PeerProc, results

pytestmark = pytest.mark.slow

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 0.5,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 20,
    "PEER_ELASTIC_SNAPSHOT_EVERY": 0.5,
    "WORKER_SAMPLES": 320,
    "WORKER_STEP_S": 0.03,
}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             peers: list[PeerProc]) -> None:
    """Poll a condition on files or output (bounded); fail with the peers' output."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = bool(peers) and all(p.proc.poll() is not None for p in peers)
        if time.monotonic() > deadline or ended:
            raise AssertionError(f"no {what}:\n" + "\n".join(p.output() for p in peers))
        time.sleep(0.1)


def lines(p: PeerProc, prefix: str) -> list[list[str]]:
    with p.cond:
        return [line.split()[1:] for line in p.lines if line.startswith(prefix + " ")]


def first_commits_after(p: PeerProc, n_starts: int) -> int:
    """The commit count of the ``n_starts``-th START line of ``p`` (0-based)."""
    return int(lines(p, "START")[n_starts][2])


def cli(etcd: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args, "--etcd", etcd],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def finish_one(p: PeerProc, others: list[PeerProc]) -> dict:
    assert p.wait(180) == 0, p.output() + "\n".join(o.output()[-3000:] for o in others)
    (result,) = results([p])
    assert result["exact"] and result["identical"], result
    return result


def test_a_parked_peer_goes_on_from_the_newest_snapshot_when_the_roster_dies(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    directory = SnapshotDir(tmp_path / "snaps", unique_job)
    end = tmp_path / "end"
    cluster = Cluster(etcd, unique_job, PEER_ELASTIC_SNAPSHOT_DIR=tmp_path / "snaps",
                      PEER_ELASTIC_MIN_NP=1, WORKER_EPOCHS=30, WORKER_END_FILE=end,
                      WORKER_RECORD="indices", WORKER_COMMIT_EVERY=5, **SETTINGS)
    try:
        peers = cluster.start(3)
        for p in peers:
            p.wait_line("GEN", timeout=120)
        wait_for(lambda: len(directory.names()) >= 1, 90, "a first snapshot", peers)
        assert "max_np=2" in cli(etcd, "set", "--job", unique_job, "max_np=2")
        # The parked peer is the one that formed no group of two.
        wait_for(lambda: sum(any(g[2] == "2" for g in lines(p, "GEN")) for p in peers) == 2,
                 120, "a group of two", peers)
        (parked,) = [p for p in peers if not any(g[2] == "2" for g in lines(p, "GEN"))]
        trained = [p for p in peers if p is not parked]
        at_park = directory.newest_valid()
        assert at_park is not None
        # The two train on, and snapshots get well ahead of what the parked peer holds.
        wait_for(lambda: (directory.newest_valid() or at_park).id.commits
                 >= at_park.id.commits + 10, 120, "snapshots past the park", peers)
        starts_before = len(lines(parked, "START"))
        for p in trained:
            p.signal(signal.SIGKILL)
        for p in trained:
            p.wait(30)
        newest = directory.newest_valid()
        assert newest is not None
        parked.wait_line("START", timeout=120, after=0)
        wait_for(lambda: len(lines(parked, "START")) > starts_before, 120,
                 "the parked peer's group", peers)
        resumed_at = first_commits_after(parked, starts_before)
        # Never behind the newest snapshot written before the roster died.
        assert resumed_at >= newest.id.commits > at_park.id.commits, (
            resumed_at, newest.id.name, at_park.id.name)
        out = parked.output()
        assert "resuming job" in out, out
        end.touch()
        finish_one(parked, trained)
    finally:
        cluster.close()


def _run_key_gone(etcd: str, job: str) -> Callable[[], bool]:
    def gone() -> bool:
        client = EtcdClient(etcd)
        try:
            return client.get(JobKeys(job).run_key) is None
        finally:
            client.close()
    return gone


def test_a_reused_job_name_with_another_model_keeps_and_resumes_its_own_snapshots(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    directory = SnapshotDir(snaps, unique_job)
    base = dict(PEER_ELASTIC_SNAPSHOT_DIR=snaps, PEER_ELASTIC_RUN_TTL=3, **SETTINGS)
    first = Cluster(etcd, unique_job, **{**base, "WORKER_SAMPLES": 160, "WORKER_EPOCHS": 2})
    try:
        run1 = first.start(2)
        for p in run1:
            assert p.wait(180) == 0, p.output()
        assert results(run1)[0]["exact"]
    finally:
        first.close()
    old = set(directory.names())
    assert old, "the first run wrote no snapshot"
    wait_for(_run_key_gone(etcd, unique_job), 60, "the first run's keys to expire", [])

    # Run 2: another model (more samples), long enough to be killed mid-way.
    end = tmp_path / "end"
    second = Cluster(etcd, unique_job, **{**base, "WORKER_SAMPLES": 240, "WORKER_EPOCHS": 30,
                                          "WORKER_END_FILE": end})
    try:
        run2 = second.start(2)
        wait_for(lambda: len(set(directory.names()) - old) >= 2, 120,
                 "two snapshots of the second run", run2)
        for p in run2:
            p.signal(signal.SIGKILL)
        for p in run2:
            p.wait(30)
        mine = sorted(set(directory.names()) - old)
        assert mine, "the second run's snapshots were deleted"
        assert max(directory.names()) == mine[-1]  # its lineage outranks the old run's
        newest = directory.newest_valid()
        assert newest is not None and newest.id == mine[-1]
        again = second.start(2)
        for p in again:
            p.wait_line("START", timeout=120)
        starts = [int(lines(p, "START")[0][2]) for p in again]
        assert min(starts) == newest.id.commits > 0, (starts, newest.id.name)
        end.touch()
        for p in again:
            assert p.wait(180) == 0, p.output()
        (result,) = results(again)
        assert result["exact"] and result["identical"], result
    finally:
        second.close()


def test_a_resume_slower_than_the_collective_timeout_finishes(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    directory = SnapshotDir(snaps, unique_job)
    end = tmp_path / "end"
    settings = {**SETTINGS, "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 5}
    cluster = Cluster(etcd, unique_job, PEER_ELASTIC_SNAPSHOT_DIR=snaps, WORKER_EPOCHS=30,
                      WORKER_END_FILE=end, **settings)
    try:
        peers = cluster.start(2)
        wait_for(lambda: len(directory.names()) >= 2, 120, "two snapshots", peers)
        for p in peers:
            p.signal(signal.SIGKILL)
        for p in peers:
            p.wait(30)
        newest = directory.newest_valid()
        assert newest is not None
        # Verifying takes 12 s: more than twice the collective timeout.
        again = cluster.start(2, WORKER_SLOW_RESUME_S=12)
        for p in again:
            p.wait_line("START", timeout=180)
        assert min(int(lines(p, "START")[0][2]) for p in again) == newest.id.commits
        assert sum("SLOW_RESUME" in p.output() for p in again) == 1  # one loader, once
        end.touch()
        for p in again:
            assert p.wait(180) == 0, p.output()
        (result,) = results(again)
        assert result["exact"] and result["identical"], result
    finally:
        cluster.close()
