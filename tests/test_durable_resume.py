"""Whole-job resume from durable snapshots: real etcd, real peer processes, the oracle.

Every peer of a job is SIGKILLed mid-epoch (a correlated failure: a rack, a preemption),
then the job is started again, with the same number of peers and with another. The job's
final state must count every sample of every epoch exactly once (tests/helpers/
elastic_worker.py): the model's counts and the sampler's progress come from the same
snapshot, so the work after the last snapshot is redone, and counted once. Each test also
checks that the restarted job did resume (its first state holds committed work) rather than
train from scratch, which would pass the oracle too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer_elastic.durable.layout import SnapshotDir
from tests.helpers.cli import cli
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.procs import Cluster, PeerProc, wait_until
from tests.helpers.worker_lines import results, starts

pytestmark = pytest.mark.slow

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 0.5,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 20,
    "PEER_ELASTIC_SNAPSHOT_EVERY": 0.5,
    "WORKER_SAMPLES": 320,
    "WORKER_EPOCHS": 3,
    "WORKER_STEP_S": 0.03,
}


cluster = cluster_fixture(SETTINGS, snapshots=True)


def kill_all_after_a_snapshot(cluster: Cluster, n: int, directory: SnapshotDir) -> int:
    """Start ``n`` peers, let them write a snapshot and train past it, SIGKILL them all.
    Returns the commits of the newest snapshot written."""
    peers = cluster.start(n)
    peers[0].wait_line("GEN", timeout=90)
    wait_until(lambda: len(directory.names()) >= 2, 90, "second snapshot", peers)
    newest = directory.newest_valid()
    assert newest is not None
    peers[0].wait_line("STEP", timeout=60, after=len(peers[0].lines))  # work after it
    for p in peers:
        p.signal(signal.SIGKILL)
    for p in peers:
        p.wait(30)
    assert not results(peers), "the job finished before it was killed: make it longer"
    return directory.newest_valid().id.commits


def end_after_resumed_epoch(p: PeerProc, end: Path) -> None:
    """Create the end file once ``p`` trains inside the resumed epoch: the job then ends at
    the next epoch start, so it ends on whole epochs (created before the resumed epoch's own
    start check, it would end the job mid-epoch and the oracle would count that epoch short)."""
    start = p.wait_line("START", timeout=90)
    with p.cond:
        after = p.lines.index(start)
    p.wait_line("STEP", timeout=90, after=after)
    end.touch()


def finish(peers: list[PeerProc]) -> dict:
    for p in peers:
        assert p.wait(120) == 0, p.output()
    (result,) = results(peers)
    assert result["exact"], result
    assert result["identical"], result
    return result


def corrupt_newest(directory: SnapshotDir) -> None:
    """Flip one byte in the middle of the newest snapshot's tensor file: same size, so only
    the checksum tells."""
    tensors = next(p for p in directory.snapshot_path(directory.names()[-1]).iterdir()
                   if p.suffix == ".distcp")
    raw = bytearray(tensors.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tensors.write_bytes(bytes(raw))


@pytest.mark.parametrize("before,after,corrupt", [(2, 2, False), (1, 2, True)],
                         ids=["same-count", "more-peers-corrupt-newest"])
def test_kill_every_peer_then_resume(cluster: Cluster, tmp_path: Path, unique_job: str,
                                     before: int, after: int, corrupt: bool) -> None:
    directory = SnapshotDir(tmp_path / "snaps", unique_job)
    kill_all_after_a_snapshot(cluster, before, directory)
    newest = directory.newest_valid()
    expected = newest.id.commits
    if corrupt:
        corrupt_newest(directory)
        expected = directory.names()[-2].commits
    peers = cluster.start(after)
    result = finish(peers)
    assert result["world"] == after
    firsts = [starts(p)[0] for p in peers if starts(p)]
    # The restarted job's first state is that of the newest valid snapshot: nobody wrote a
    # newer one, everyone was dead.
    assert min(s[2] for s in firsts) == expected > 0, (firsts, expected)
    out = "\n".join(line for p in peers for line in p.lines)
    assert "resuming job" in out
    assert ("cannot be loaded, trying an older one" in out) == corrupt


def test_drain_all_writes_a_final_snapshot_and_a_restart_resumes_from_it(
        cluster: Cluster, tmp_path: Path, unique_job: str, etcd: str) -> None:
    directory = SnapshotDir(tmp_path / "snaps", unique_job)
    end = tmp_path / "end"  # long enough never to finish by itself; ended through this file
    cluster.env.update(WORKER_EPOCHS="30", WORKER_END_FILE=str(end))
    peers = cluster.start(2, PEER_ELASTIC_SNAPSHOT_EVERY=300)  # only the final one
    wait_until(lambda: any(line.startswith("STEP 1 ") for line in peers[0].lines), 120,
               "epoch 1", peers)
    assert directory.names() == []
    asked = time.time()
    assert "asked all 2 members" in cli(etcd, "drain", "--all", "--job", unique_job)
    for p in peers:
        assert p.wait(60) == 0, p.output()
    assert not results(peers), "drained, not finished"
    final = directory.newest_valid()
    assert final is not None and final.unix > asked and final.epoch >= 1
    listed = json.loads(cli(etcd, "snapshots", "--json", "--job", unique_job))
    assert [d["name"] for d in listed] == [final.id.name]
    assert listed[0]["checksum"] == final.digest()

    # Fewer peers than before; the run still exists, so its settings must match.
    again = cluster.start(1, PEER_ELASTIC_SNAPSHOT_EVERY=300)
    again[0].wait_line("START", timeout=90)
    status = json.loads(cli(etcd, "status", "--json", "--job", unique_job))
    assert status["snapshot"]["name"] == final.id.name
    end_after_resumed_epoch(again[0], end)
    result = finish(again)
    firsts = [starts(p)[0] for p in again if starts(p)]
    # Nothing lost: the restart begins exactly where the drained job stopped.
    assert min(s[2] for s in firsts) == final.id.commits
    assert result["epochs"] > final.epoch


def test_the_documented_snapshot_example_runs(etcd: str, unique_job: str, tmp_path: Path) -> None:
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    section = api.split("## Durable snapshots", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for old, new in (('etcd="127.0.0.1:2379"', f'etcd="{etcd}"'),
                     ('job="demo"', f'job="{unique_job}"'),
                     ('snapshot_dir="/shared/snapshots"', f'snapshot_dir="{tmp_path}"'),
                     ("snapshot_every_s=60", "snapshot_every_s=0.2")):
        assert old in code
        code = code.replace(old, new)
    script = tmp_path / "readme_snapshots.py"
    script.write_text(code)
    env = {**os.environ, "PEER_ELASTIC_START_SETTLE": "0.2"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert SnapshotDir(tmp_path, unique_job).newest_valid() is not None


def test_sigterm_of_the_last_peer_writes_a_final_snapshot(cluster: Cluster, tmp_path: Path,
                                                          unique_job: str) -> None:
    directory = SnapshotDir(tmp_path / "snaps", unique_job)
    end = tmp_path / "end"
    cluster.env.update(WORKER_EPOCHS="30", WORKER_END_FILE=str(end),
                       PEER_ELASTIC_SNAPSHOT_EVERY="300")
    (peer,) = cluster.start(1)
    peer.wait_line("STEP 1 ", timeout=120)
    asked = time.time()
    peer.signal(signal.SIGTERM)  # systemctl stop, a preemption notice
    assert peer.wait(60) == 0, peer.output()
    final = directory.newest_valid()
    assert final is not None and final.unix > asked, peer.output()
    (again,) = cluster.start(1)
    end_after_resumed_epoch(again, end)
    finish([again])
    assert starts(again)[0][2] == final.id.commits


def test_a_full_disk_does_not_stop_training(etcd: str, unique_job: str, tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mnt)], capture_output=True,
        timeout=10).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    c = Cluster(etcd, unique_job, PEER_ELASTIC_SNAPSHOT_DIR=mnt, **SETTINGS)
    try:
        (peer,) = c.start(1)
        finish([peer])  # the oracle holds: every sample once, snapshots or not
        out = peer.output()
        assert "durable snapshot" in out and "not written" in out, out
        assert SnapshotDir(mnt, unique_job).newest_valid() is None
    finally:
        c.close()
        subprocess.run(["umount", "-l", str(mnt)], timeout=10)
