"""Elastic sharded state on real peers: FSDP2 and HSDP models through crashes, leaves and joins.

Real etcd, real peer processes on gloo (tests/helpers/elastic_worker.py with
``WORKER_SHARDED``): the counter model is sharded with FSDP2 and summed gradients, the
network's Adam state is sharded too, and the job ends with the exactly-once oracle on the
gathered counter and every rank's gathered state identical. With ``WORKER_COMMIT_DIGEST`` each
commit prints the gathered state's digest, so the state a reset rebuilt in memory is compared
bit for bit with the commit it came from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import cli
from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.procs import Cluster, PeerProc, wait_until
from tests.helpers.worker_lines import (
    callback_digests,
    committed_digests,
    start_world_of_3,
    wait_more_steps,
    wait_world,
)

pytestmark = pytest.mark.slow

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 20,
    "PEER_ELASTIC_MIN_NP": 1,
    "WORKER_SAMPLES": 240,
    "WORKER_STEP_S": 0.02,
    "WORKER_SHARDED": "fsdp",
    "WORKER_COMMIT_DIGEST": 1,
}


cluster = cluster_fixture(SETTINGS)


def result_of(peers: list[PeerProc]) -> dict:
    for p in peers:
        with p.cond:
            lines = [line for line in p.lines if line.startswith("RESULT ")]
        if lines:
            return json.loads(lines[-1].split(" ", 1)[1])
    raise AssertionError("no RESULT line:\n" + "\n".join(p.output() for p in peers))


def rebuilt_states(p: PeerProc) -> list[tuple[int, int, int, str]]:
    """(generation, size, commits, digest) of each group ``p`` trained in: the digest its
    reset callback printed (the state the group rebuilt) and the commit count it started at."""
    out = []
    digest, gen, size = "", 0, 0
    with p.cond:
        for line in p.lines:
            if line.startswith("CALLBACK "):
                digest = line.split()[2]
            elif line.startswith("GEN "):
                gen, size = int(line.split()[1]), int(line.split()[3])
            elif line.startswith("START "):
                out.append((gen, size, int(line.split()[3]), digest))
    return out


def assert_rebuilt_from_commits(peers: list[PeerProc], survivor: PeerProc) -> int:
    """Every group the survivor trained in after the first started from a state bit-identical
    to the commit it names (when that commit printed its digest); returns how many matched."""
    commits = committed_digests(peers)
    assert all(len(d) == 1 for d in commits.values()), commits
    matched = 0
    for gen, size, count, digest in rebuilt_states(survivor)[1:]:
        if count in commits:
            assert {digest} == commits[count], (gen, size, count, digest, commits[count])
            matched += 1
    return matched


def finish(peers: list[PeerProc], timeout: float = 240) -> dict:
    for p in peers:
        code = p.wait(timeout)
        assert code == 0, p.output()
    r = result_of(peers)
    assert r["exact"], r
    assert r["identical"], r
    return r


def test_a_crashed_peer_s_shard_comes_from_its_copy_and_the_state_is_the_commit(
        cluster: Cluster) -> None:
    # Three peers, FSDP over 3; SIGKILL of a non-leader between commits: the survivors go on
    # from the last commit resharded to 2, with no disk, and the rebuilt state is the
    # commit's bit for bit. Under load the peers may register apart and train in smaller
    # worlds first: the crash comes once all three train together.
    peers = cluster.start(3, WORKER_EPOCHS=2, WORKER_COMMIT_EVERY=3)
    a, b, c = start_world_of_3(*peers)  # by rank: a leads
    wait_more_steps(a, 4)
    b.signal(signal.SIGKILL)
    finish([a, c])
    sizes = [size for _, size, _, _ in rebuilt_states(a)]
    assert 2 in sizes[sizes.index(3):], sizes
    assert assert_rebuilt_from_commits(peers, a) >= 1
    assert all(len(d) == 1 for d in callback_digests([a, c]).values())


def test_the_leader_crashes_then_a_peer_joins_and_one_leaves(cluster: Cluster,
                                                              tmp_path) -> None:
    # The leader's shard comes from its copy; the joiner receives only its own rows; the
    # SIGTERMed peer's shard moves to the ranks that stay before it goes. The job runs until
    # the schedule is done (WORKER_END_FILE), however slowly a loaded machine steps.
    end = tmp_path / "end"
    env = dict(WORKER_EPOCHS=500, WORKER_END_FILE=end, WORKER_SAMPLES=120,
               WORKER_RECORD="indices", WORKER_PLAIN=1)
    peers = cluster.start(3, **env)
    a, b, c = peers
    for p in peers:
        p.wait_line("GEN", timeout=90)
    wait_more_steps(b, 4)
    a.signal(signal.SIGKILL)  # the leader, rank 0
    wait_more_steps(b, 4)
    (d,) = cluster.start(1, **env)
    d.wait_line("GEN", timeout=90)
    wait_more_steps(d, 3)
    c.signal(signal.SIGTERM)  # graceful: its shard moves before it goes
    assert c.wait(90) == 0, c.output()
    wait_more_steps(d, 3)
    end.touch()
    r = finish([b, d])
    assert r["plain_ok"] and r["world"] == 2, r
    assert r["states_lost"] == 0, r
    assert all(len(dg) == 1 for dg in callback_digests([b, c, d]).values())
    assert assert_rebuilt_from_commits([a, b, c, d], b) >= 1


# -- beyond the redundancy, and durable snapshots -----------------------------------------------

def test_losing_more_peers_than_the_redundancy_without_snapshots_fails_clearly(
        cluster: Cluster) -> None:
    # redundancy 1, four peers: two die at once (SIGKILL together). With the copies spread
    # around the ring some pairs are covered, so kill a pair whose shards share no holder:
    # with redundancy 0 any one death loses a shard, which is the simplest case to force.
    peers = cluster.start(3, WORKER_EPOCHS=50, WORKER_SHARDED="fsdp,redundancy=0")
    a, b, c = peers
    for p in peers:
        p.wait_line("GEN", timeout=90)
    wait_more_steps(a, 4)
    b.signal(signal.SIGKILL)
    for p in (a, c):
        assert p.wait(120) == 4, p.output()  # EXIT_JOB_FAILED: the job failed as a whole
    out = a.output() + c.output()
    assert "sharded state lost" in out and "has no snapshot_dir" in out, out
    assert not [line for p in (a, c) for line in p.lines if line.startswith("RESULT ")]


def snapshot_names(directory) -> list:  # type: ignore[no-untyped-def]
    return [sid for sid in directory.names()]


@pytest.mark.parametrize("before,after", [(3, 2), (2, 4)], ids=["3-to-2", "2-to-4"])
def test_a_whole_job_restart_resumes_its_sharded_snapshot_at_another_world_size(
        etcd: str, unique_job: str, tmp_path, before: int, after: int) -> None:
    from peer_elastic.durable.layout import SnapshotDir

    snaps = tmp_path / "snaps"
    settings = {**SETTINGS, "PEER_ELASTIC_SNAPSHOT_DIR": snaps,
                "PEER_ELASTIC_SNAPSHOT_EVERY": 0.5, "WORKER_EPOCHS": 3,
                "WORKER_SAMPLES": 240, "WORKER_STEP_S": 0.03}
    directory = SnapshotDir(snaps, unique_job)
    c = Cluster(etcd, unique_job, **settings)
    try:
        peers = c.start(before)
        for p in peers:  # under load they may register apart and form smaller worlds first
            wait_world(p, before, 90, seen=0)

        def newest_of_the_whole_world() -> bool:
            newest = directory.newest_complete(sharded=True)
            return newest is not None and newest.world_size == before

        wait_until(lambda: len(directory.names()) >= 2 and newest_of_the_whole_world(), 120,
                   f"a second snapshot, the newest of a world of {before}", peers)
        peers[0].wait_line("STEP", timeout=60, after=len(peers[0].lines))
        for p in peers:
            p.signal(signal.SIGKILL)
        for p in peers:
            p.wait(30)
        newest = directory.newest_complete(sharded=True)
        assert newest is not None and newest.world_size == before
        restarted = c.start(after)
        r = finish(restarted)
        assert r["world"] == after, r
        firsts = [rebuilt_states(p)[0] for p in restarted if rebuilt_states(p)]
        assert min(f[2] for f in firsts) >= newest.id.commits > 0, (firsts, newest.id)
        out = "\n".join(line for p in restarted for line in p.lines)
        assert "resuming job" in out and "sharded snapshot" in out
    finally:
        c.close()


def test_losing_more_peers_than_the_redundancy_falls_back_to_the_snapshot(
        cluster: Cluster, tmp_path) -> None:
    peers = cluster.start(3, WORKER_EPOCHS=4, WORKER_SHARDED="fsdp,redundancy=0",
                          PEER_ELASTIC_SNAPSHOT_DIR=tmp_path / "snaps",
                          PEER_ELASTIC_SNAPSHOT_EVERY=0.3)
    a, b, c = peers
    for p in peers:
        p.wait_line("GEN", timeout=90)
    wait_more_steps(a, 12)
    b.signal(signal.SIGKILL)
    r = finish([a, c])
    assert r["states_lost"] >= 1 or "resuming job" in a.output(), r
    assert "resuming job" in a.output() + c.output()


def wait_text(p: PeerProc, text: str, count: int = 1, timeout: float = 120) -> None:
    """Until ``p`` printed ``count`` lines containing ``text`` (bounded)."""
    deadline = time.monotonic() + timeout
    with p.cond:
        while sum(text in line for line in p.lines) < count:
            left = deadline - time.monotonic()
            if left <= 0 or p.proc.poll() is not None:
                raise AssertionError(f"{p.name}: not {count} x {text!r}:\n{p.output()}")
            p.cond.wait(min(left, 0.5))


def test_the_fsdp_example_trains_through_a_crash_and_a_join(etcd: str, unique_job: str) -> None:
    # The documented example, as a user runs it, with a crash and a join while it trains.
    env = {**os.environ, "PEER_ELASTIC_ETCD": etcd, "PEER_ELASTIC_JOB": unique_job,
           "PEER_ELASTIC_START_SETTLE": "0.5", "PEER_ELASTIC_LEASE_TTL": "3",
           "PEER_ELASTIC_JOIN_TIMEOUT": "1.5", "PEER_ELASTIC_LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "examples/train_fsdp.py", "--epochs", "25", "--target", "0.85"]
    peers = [PeerProc(args, env, f"fsdp{i}") for i in range(3)]
    try:
        for p in peers:
            wait_text(p, "ready: rank")
        peers[1].signal(signal.SIGKILL)
        wait_text(peers[0], "ready: rank", count=2)
        joiner = PeerProc(args, env, "fsdp3")
        peers.append(joiner)
        wait_text(joiner, "ready: rank")
        for p in (peers[0], peers[2], joiner):
            assert p.wait(300) == 0, p.output()
        out = "\n".join(line for p in peers for line in p.lines)
        assert "test accuracy" in out and "resharded" in out, out[-3000:]
        assert "state_lost" not in out and "Traceback" not in out
    finally:
        for p in peers:
            p.kill()


def test_hsdp_resizes_down_and_up_and_comes_back_bit_identical(
        cluster: Cluster, etcd: str, unique_job: str, tmp_path) -> None:
    # HSDP, shard groups of 2: four peers run 2 x 2. set max_np=3 parks one as a standby
    # (graceful: its shard is handed to the ranks that stay) and 3 ranks shard 1 x 3 (3 does
    # not factor by 2: shards get finer, never coarser); a crash of a running peer promotes
    # the standby (it receives only its rows); set max_np=4 and a new peer bring back 2 x 2
    # (N -> N-1 -> N). Every rebuilt state is its commit's, bit for bit. A long start settle:
    # the first generation forms the moment all four are there (max_np), never with fewer
    # (on a loaded machine they register apart), so the generations counted below are
    # exactly those of the resizes.
    end = tmp_path / "end"
    env = dict(WORKER_EPOCHS=500, WORKER_END_FILE=end, WORKER_SHARDED="hsdp:2",
               WORKER_SAMPLES=120, WORKER_RECORD="indices", PEER_ELASTIC_MAX_NP=4,
               PEER_ELASTIC_START_SETTLE=60)
    peers = cluster.start(4, **env)
    for p in peers:
        p.wait_line("GEN", timeout=90)
    # the leader (rank 0, the oldest): never the one parked
    a = next(p for p in peers if p.wait_line("GEN").split()[2] == "0")
    wait_more_steps(a, 3)
    assert "max_np=3" in cli(etcd, "set", "--job", unique_job, "max_np=3")
    wait_text(a, "GEN ", count=2)
    wait_more_steps(a, 3)
    running = [p for p in peers if p is not a and sum("GEN " in line for line in p.lines) >= 2]
    running[-1].signal(signal.SIGKILL)
    wait_text(a, "GEN ", count=3)
    wait_more_steps(a, 3)
    assert "max_np=4" in cli(etcd, "set", "--job", unique_job, "max_np=4")
    (d,) = cluster.start(1, **env)
    wait_text(a, "GEN 1", count=1)
    deadline = time.monotonic() + 120
    while not any(size == 4 for _, size, _, _ in rebuilt_states(a)[1:]):
        assert time.monotonic() < deadline, a.output()
        wait_more_steps(a, 1)
    wait_more_steps(a, 3)
    end.touch()
    survivors = [p for p in [*peers, d] if p.proc.poll() is None]
    r = finish(survivors)
    assert r["world"] == 4 and r["layout"] == [2, 2], r
    assert r["states_lost"] == 0, r
    sizes = [size for _, size, _, _ in rebuilt_states(a)]
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 4, sizes
    assert all(len(dg) == 1 for dg in callback_digests([*peers, d]).values())
    assert assert_rebuilt_from_commits([*peers, d], a) >= 1


def test_the_documented_sharded_example_runs_on_two_peers(etcd: str, unique_job: str,
                                                      tmp_path) -> None:
    import re
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", api, re.S)
                if "pe.ShardedState(" in block)
    assert 'etcd="127.0.0.1:2379"' in code and 'job="demo"' in code
    code = code.replace('etcd="127.0.0.1:2379"', f'etcd="{etcd}"').replace(
        'job="demo"', f'job="{unique_job}"')
    script = tmp_path / "readme_sharded.py"
    script.write_text(code + "\nprint('OK', state.commit_count, flush=True)\n")
    env = {**os.environ, "PEER_ELASTIC_START_SETTLE": "0.5"}
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o.strip().splitlines()[-1].startswith("OK ") for o in outs), outs


@pytest.mark.parametrize("start", ["together", "one-late"])
@pytest.mark.parametrize("phase", ["transfer", "confirm"])
def test_a_peer_dying_inside_a_save_loses_nothing(cluster: Cluster, phase: str, start: str,
                                                 tmp_path: Path) -> None:
    # The window a crash between commits never sees: a peer dies while its copies travel
    # (the others keep the previous save whole) or after they arrived but before the save is
    # confirmed (the new version is whole: the others' own rows are their live ones). One
    # peer dies: the first to be rank 1 at its 8th save. One started late (or slow to join
    # the first group) gets there later, maybe as rank 1 again, and must not die too; the
    # death may then come in a group of two, before it joins.
    env = dict(WORKER_EPOCHS=2, WORKER_DIE_IN_SAVE=f"8:1:{phase}",
               WORKER_DIE_FLAG=tmp_path / "died")
    peers = cluster.start(3 if start == "together" else 2, **env)
    if start == "one-late":
        peers[0].wait_line("COMMITTED 1", timeout=90)
        peers += cluster.start(1, **env)

    def dying_peers() -> list[PeerProc]:
        return [p for p in peers if any(line.startswith("DYING ") for line in list(p.lines))]

    wait_until(lambda: bool(dying_peers()), 210, "peer dying in a save", peers)
    (dying,) = dying_peers()
    dying.wait(30)
    survivors = [p for p in peers if p is not dying]
    r = finish(survivors)
    assert r["states_lost"] == 0 and r["world"] == 2, r
    assert "sharded state lost" not in "\n".join(p.output() for p in survivors)
    assert all(len(d) == 1 for d in callback_digests(survivors).values())
    if phase == "transfer":  # the commit in flight did not happen: back to the one before
        assert assert_rebuilt_from_commits(peers, survivors[0]) >= 1
    else:  # every copy of the commit in flight had arrived: it happened, nothing is redone
        died_in = rebuilt_states(dying)[-1][0]  # the generation of the save it died in
        restarted = next(count for gen, _, count, _ in rebuilt_states(survivors[0])
                         if gen > died_in)
        assert restarted == max(committed_digests([dying])) + 1, restarted
