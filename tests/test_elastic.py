"""Real elastic training: 2-4 processes on gloo over a real etcd, with faults mid-epoch.

Each test runs tests/helpers/elastic_worker.py peers and ends with the exactly-once oracle:
every sample of every epoch counted exactly once in the committed model, and every rank
bit-identical.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.cluster_fixture import cluster_fixture
from tests.helpers.procs import Cluster, assert_exactly_once
from tests.helpers.worker_lines import (
    callback_digests,
    gen_lines,
    result_of,
    results,
    starts,
    wait_more_steps,
)

pytestmark = pytest.mark.slow

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 20,
    "WORKER_SAMPLES": 960,
    "WORKER_STEP_S": 0.03,
}


cluster = cluster_fixture(SETTINGS)


def test_join_leave_and_crashes_between_fast_checks_count_every_sample_once(cluster: Cluster,
                                                                   tmp_path) -> None:
    # The schedule: join, graceful leave, crash of a non-leader, crash of the leader; the job
    # must finish with an exact count on every survivor. The job runs until the schedule is
    # done (WORKER_END_FILE), however slowly a loaded machine steps. Steps as fast as they
    # go, with DDP (no optimizer step carries the exchange) and a check after every step
    # between rare commits: only every P-th check exchanges (peer_elastic.torch.
    # check_cadence), and every event must still reach every rank at the same check. Whether
    # checks are spaced depends on how fast this machine steps (under 20 ms apart); under
    # load they may not be, so that spacing happens at all is tests/test_check_cadence.py's.
    end = tmp_path / "end"
    env = dict(PEER_ELASTIC_MIN_NP=1, WORKER_EPOCHS=2000, WORKER_END_FILE=end, WORKER_STEP_S=0,
               WORKER_SAMPLES=240, WORKER_DDP=1, WORKER_CHECK_EVERY=1, WORKER_COMMIT_EVERY=10)
    a, b = cluster.start(2, **env)
    a.wait_line("GEN")
    wait_more_steps(a, 3)
    (c,) = cluster.start(1, **env)  # join mid-epoch
    c.wait_line("GEN", timeout=90)
    wait_more_steps(c, 3)
    (d,) = cluster.start(1, **env)
    d.wait_line("GEN", timeout=90)
    wait_more_steps(d, 2)
    b.signal(signal.SIGTERM)  # graceful leave
    assert b.wait(60) == 0, b.output()
    wait_more_steps(c, 3)
    c.signal(signal.SIGKILL)  # crash of a non-leader
    wait_more_steps(a, 3)
    a.signal(signal.SIGKILL)  # crash of the leader (the oldest member, rank 0)
    wait_more_steps(d, 3)
    end.touch()
    assert d.wait(180) == 0, d.output()
    r = result_of(d)
    assert r["exact"], r
    assert r["identical"] and r["world"] == 1 and r["rank"] == 0  # the oldest survivor
    assert r["check_exchanges"] > 0, r
    # b left without a rollback and c joined mid-epoch: generations it saw are ordered.
    assert [g for g, _, _ in gen_lines(d)] == sorted({g for g, _, _ in gen_lines(d)})
    # Every reset is in the event log with where its time went.
    r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "events", "--etcd",
                        cluster.env["PEER_ELASTIC_ETCD"], "--job", cluster.env["PEER_ELASTIC_JOB"],
                        "--json"], capture_output=True, text=True, timeout=60)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    formed = [e for e in events if e["kind"] == "generation formed"]
    assert len(formed) >= 3, r.stdout + r.stderr
    for e in formed:
        t = e["timings_s"]
        assert set(t) == {"detected_to_written", "written_to_formed", "formed_to_synced",
                          "synced_to_first_step", "total"}
        assert 0 <= t["total"] < 60
    kinds = {e["kind"] for e in events}
    assert {"joined", "left", "expired", "drain requested"} <= kinds, kinds


def test_standby_is_promoted_and_a_stalled_peer_rejoins(cluster: Cluster) -> None:
    # max_np=2: the third peer waits as a standby. A roster member stalled past its lease
    # TTL (SIGSTOP) is replaced by the standby; on SIGCONT it rejoins as a new member.
    env = dict(PEER_ELASTIC_MIN_NP=1, PEER_ELASTIC_MAX_NP=2, WORKER_EPOCHS=3,
               PEER_ELASTIC_COLLECTIVE_TIMEOUT=6)
    a, b = cluster.start(2, **env)
    a.wait_line("GEN")
    wait_more_steps(a, 2)
    (s,) = cluster.start(1, **env)
    wait_more_steps(a, 6)
    assert not gen_lines(s), "a standby must not train"
    b.signal(signal.SIGSTOP)
    s.wait_line("GEN", timeout=90)  # promoted
    wait_more_steps(s, 3)
    b.signal(signal.SIGCONT)  # it lost its lease: it must stop and rejoin, not corrupt
    for p in (a, b, s):
        code = p.wait(240)
        assert code == 0, p.output()
    r = next(result_of(p) for p in (a, b, s) if any(x.startswith("RESULT") for x in p.lines))
    assert r["exact"] and r["identical"], r


def test_reset_callbacks_see_world_size_and_reset_limit_stops_the_job(cluster: Cluster) -> None:
    # max_np=2 with a long start settle: the first generation forms the moment both peers
    # are there, never with one alone (on a loaded machine they register apart, and a
    # second generation for the late one would use up the one allowed reset).
    env = dict(PEER_ELASTIC_MIN_NP=1, PEER_ELASTIC_MAX_NP=2, PEER_ELASTIC_START_SETTLE=60,
               PEER_ELASTIC_RESET_LIMIT=1, WORKER_EPOCHS=50)
    a, b = cluster.start(2, **env)
    a.wait_line("GEN")
    wait_more_steps(a, 2)
    b.signal(signal.SIGTERM)  # reset 1: allowed
    assert b.wait(60) == 0
    wait_more_steps(a, 2)
    (c,) = cluster.start(1, **env)  # reset 2: over the limit
    assert a.wait(90) == 4  # EXIT_JOB_FAILED: systemd must not restart it
    assert "reset limit" in a.output() and "Traceback" not in a.output()
    assert c.wait(60) == 4


@pytest.mark.parametrize("hook", [False, True], ids=["ddp-reducer", "pe.allreduce_hook"])
def test_ddp_rebuilt_in_a_reset_callback_survives_join_and_crash(cluster: Cluster,
                                                                 hook: bool, tmp_path) -> None:
    # The documented recipe: DDP is rebuilt on each new group by a reset callback; with the
    # hook, the reset vote rides on DDP's gradients, and checks between commits use it. The
    # job runs until the events are done (WORKER_END_FILE): a joiner slow to start on a
    # loaded machine must not find it finished.
    end = tmp_path / "end"
    env = dict(PEER_ELASTIC_MIN_NP=1, WORKER_EPOCHS=200, WORKER_END_FILE=end, WORKER_DDP=1,
               WORKER_DDP_HOOK=int(hook), WORKER_CHECK_EVERY=1 if hook else 0)
    a, b = cluster.start(2, **env)
    a.wait_line("GEN")
    wait_more_steps(a, 3)
    (c,) = cluster.start(1, **env)  # join: everyone rebuilds DDP for world 3
    c.wait_line("GEN", timeout=90)
    wait_more_steps(c, 3)
    b.signal(signal.SIGKILL)  # crash: rebuild for world 2, after a rollback
    wait_more_steps(c, 3)
    end.touch()
    for p in (a, c):
        assert p.wait(180) == 0, p.output()
    r = result_of(a)
    assert r["exact"] and r["identical"] and r["world"] == 2, r
    if hook:  # every check after a step took the step's vote: none exchanged its own
        assert r["check_exchanges"] == 0, r
    # The callbacks (DDP rebuilt there) ran after the sync: in each generation every rank
    # held the same state in them, the joiner (other initial weights) included.
    digests = callback_digests([a, b, c])
    assert len(digests) >= 3 and all(len(d) == 1 for d in digests.values()), digests
    # A peer started after the job finished says so and exits 0.
    (late,) = cluster.start(1, **env)
    assert late.wait(60) == 0, late.output()
    assert "already finished successfully" in late.output()


def test_a_burst_of_sigterms_is_one_graceful_leave(cluster: Cluster) -> None:
    # SIGTERM comes more than once in the wild: Ctrl-C twice, a supervisor's repeat, the
    # kernel's parent-death signal again for an orphan. Handled in the signal handler, a
    # burst once left a peer stuck for good, nested in itself (peer_elastic.signal_relay;
    # 1 of 5 such bursts before). Now it is one leave: the leaver exits 0, the other trains
    # on alone and the job ends exactly once.
    a, b = cluster.start(2, WORKER_EPOCHS=1)
    a.wait_line("GEN")
    wait_more_steps(a, 2)
    for _ in range(200):  # over about a second: the leave ends meanwhile, and the rest of
        b.signal(signal.SIGTERM)  # the burst must not kill the peer on its way out
        time.sleep(0.005)
    assert b.wait(60) == 0, b.output()
    assert_exactly_once([a, b])


def test_sigterm_below_min_np_lets_the_leaver_go_and_the_rest_wait(cluster: Cluster) -> None:
    env = dict(PEER_ELASTIC_MIN_NP=2, PEER_ELASTIC_ELASTIC_TIMEOUT=4, WORKER_EPOCHS=50)
    a, b = cluster.start(2, **env)
    a.wait_line("GEN")
    wait_more_steps(a, 2)
    b.signal(signal.SIGTERM)
    assert b.wait(60) == 0, b.output()  # it leaves, although that breaks min_np
    assert a.wait(60) == 4, a.output()  # the other waits, then fails on the elastic timeout
    assert "elastic timeout" in a.output()


def test_set_epoch_at_the_start_of_every_epoch_keeps_a_resets_progress(cluster: Cluster,
                                                                        tmp_path) -> None:
    # DistributedSampler's habit: sampler.set_epoch(state.epoch) at the top of the epoch loop.
    # After a crash and a join mid-epoch the training function runs again from its top; the
    # call must keep what the reset kept, or the epoch's done samples are trained twice.
    end = tmp_path / "end"
    env = dict(WORKER_EPOCHS=200, WORKER_END_FILE=end, WORKER_SET_EPOCH_AT_START=1,
               WORKER_COMMIT_EVERY=3)
    a, b, c = cluster.start(3, **env)
    a.wait_line("GEN", timeout=90)
    wait_more_steps(a, 3)
    c.signal(signal.SIGKILL)  # mid-epoch: a rollback to the last commit
    wait_more_steps(a, 3)
    (d,) = cluster.start(1, **env)  # mid-epoch: a reset that keeps everything
    d.wait_line("GEN", timeout=90)
    wait_more_steps(d, 3)
    end.touch()
    for p in (a, b, d):
        assert p.wait(240) == 0, p.output()
    found = results([a, b, d])  # from rank 0: a or b, whichever registered first
    assert len(found) == 1, found
    r = found[0]
    assert r["exact"] and r["identical"], r
    # Re-entered in the middle of an epoch with progress held (the trap this guards).
    assert any(processed > 0 for _, processed, _ in starts(a)), a.output()
