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
from collections.abc import Callable
from pathlib import Path

import pytest

from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import JobKeys
from tests.helpers.cli import cli
from tests.helpers.procs import Cluster, PeerProc, wait_until
from tests.helpers.worker_lines import gen_lines, results, starts

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
        wait_until(lambda: len(directory.names()) >= 1, 90, "a first snapshot", peers)
        assert "max_np=2" in cli(etcd, "set", "--job", unique_job, "max_np=2")
        # The parked peer is the one that formed no group of two.
        wait_until(lambda: sum(any(size == 2 for _, _, size in gen_lines(p)) for p in peers) == 2,
                   120, "a group of two", peers)
        (parked,) = [p for p in peers if not any(size == 2 for _, _, size in gen_lines(p))]
        trained = [p for p in peers if p is not parked]
        at_park = directory.newest_valid()
        assert at_park is not None
        # The two train on, and snapshots get well ahead of what the parked peer holds.
        wait_until(lambda: (directory.newest_valid() or at_park).id.commits
                   >= at_park.id.commits + 10, 120, "snapshots past the park", peers)
        starts_before = len(starts(parked))
        for p in trained:
            p.signal(signal.SIGKILL)
        for p in trained:
            p.wait(30)
        newest = directory.newest_valid()
        assert newest is not None
        parked.wait_line("START", timeout=120, after=0)
        wait_until(lambda: len(starts(parked)) > starts_before, 120,
                   "the parked peer's group", peers)
        resumed_at = starts(parked)[starts_before][2]
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
    wait_until(_run_key_gone(etcd, unique_job), 60, "the first run's keys to expire", [])

    # Run 2: another model (more samples), long enough to be killed mid-way.
    end = tmp_path / "end"
    second = Cluster(etcd, unique_job, **{**base, "WORKER_SAMPLES": 240, "WORKER_EPOCHS": 30,
                                          "WORKER_END_FILE": end})
    try:
        run2 = second.start(2)
        wait_until(lambda: len(set(directory.names()) - old) >= 2, 120,
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
        resumed = [starts(p)[0][2] for p in again]
        assert min(resumed) == newest.id.commits > 0, (resumed, newest.id.name)
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
        wait_until(lambda: len(directory.names()) >= 2, 120, "two snapshots", peers)
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
        assert min(starts(p)[0][2] for p in again) == newest.id.commits
        assert sum("SLOW_RESUME" in p.output() for p in again) == 1  # one loader, once
        end.touch()
        for p in again:
            assert p.wait(180) == 0, p.output()
        (result,) = results(again)
        assert result["exact"] and result["identical"], result
    finally:
        cluster.close()
