"""Membership, leadership and generations on a real etcd server.

Every coordinator here has its own etcd client, as separate peers would; the kill tests run
members in their own processes (tests/helpers/member_proc.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import (
    ConfigError,
    ElasticTimeout,
    EtcdUnavailable,
    JobFinished,
    ResetLimitExceeded,
)
from peer_elastic.etcd.admin import drain, update_config
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.keys import JobKeys, RunKeys
from peer_elastic.etcd.roster import Wait, plan_next_generation
from peer_elastic.etcd.view import JobView
from peer_elastic.records import (
    GenerationCause,
    GenerationRecord,
    JobConfig,
    MemberRecord,
    RunRecord,
    decode,
    encode,
)

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0)


class Peers:
    """Coordinators of one job, each with its own client; all closed at teardown."""

    def __init__(self, endpoint: str, job: str) -> None:
        self.endpoint, self.job = endpoint, job
        self.coords: list[Coordinator] = []
        self.clients: list[EtcdClient] = []
        self.procs: list[subprocess.Popen] = []

    def start(self, n: int = 1, host: str | None = None,
              client_type: type[EtcdClient] = EtcdClient, **settings) -> list[Coordinator]:
        out = []
        for _ in range(n):
            client = client_type(self.endpoint, retry_budget_s=10)
            self.clients.append(client)
            c = Coordinator(client, self.job, JobSettings(**{**FAST, **settings}), host=host)
            self.coords.append(c)
            out.append(c.start())
        return out

    def spawn(self, **settings) -> subprocess.Popen:
        env = dict(os.environ)
        env.update({f"PEER_ELASTIC_{k.upper().removesuffix('_S')}": str(v)
                    for k, v in {**FAST, **settings}.items()})
        p = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.member_proc", self.endpoint, self.job],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait(timeout=10)
        for c in self.coords:
            c.close()
        for cl in self.clients:
            cl.close()


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 20) -> str:
    """Next stdout line of ``proc`` starting with ``prefix`` (bounded)."""
    result: list[str] = []

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(prefix):
                result.append(line.strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    assert result, f"no {prefix!r} line from pid {proc.pid} within {timeout} s"
    return result[0]


@pytest.fixture
def peers(etcd: str, unique_job: str) -> Iterator[Peers]:
    p = Peers(etcd, unique_job)
    yield p
    p.close()


def wait_gen(coords: list[Coordinator], predicate, timeout: float = 15):
    """Wait until every coordinator's view has a generation satisfying ``predicate``."""
    snaps = [c.view.wait_for(lambda s: s.generation is not None and predicate(s.generation),
                             timeout) for c in coords]
    assert all(snaps), "generation did not converge in time"
    gens = {s.generation.number for s in snaps}
    return snaps[0].generation, gens


def test_oldest_member_leads_and_ranks_agree_across_joins_and_leaves(peers: Peers) -> None:
    a, b = peers.start(2, min_np=2)
    gen, _ = wait_gen([a, b], lambda g: len(g.roster) == 2)
    assert list(gen.roster) == [a.member_id, b.member_id]
    assert a.is_leader and not b.is_leader
    (c,) = peers.start(1, min_np=2)
    gen, numbers = wait_gen([a, b, c], lambda g: len(g.roster) == 3)
    assert len(numbers) == 1
    assert [x.assignment().rank for x in (a, b, c)] == [0, 1, 2]
    assert gen.joined == [c.member_id]

    a.close()  # the leader leaves: b is now the oldest and takes over
    gen, numbers = wait_gen([b, c], lambda g: a.member_id not in g.roster)
    assert b.snapshot().departures[-1].graceful  # a deliberate exit, not a failure
    assert list(gen.roster) == [b.member_id, c.member_id]
    assert b.is_leader and gen.written_by == b.member_id
    assert list(gen.removed) == [a.member_id] and not gen.joined  # removals only
    assert {x.assignment().rank for x in (b, c)} == {0, 1}


def test_standby_is_promoted_when_a_roster_member_leaves(peers: Peers) -> None:
    a, b, s = peers.start(3, min_np=1, max_np=2)
    gen, _ = wait_gen([a, b, s], lambda g: len(g.roster) == 2)
    assert s.member_id not in gen.roster and s.assignment() is None
    b.close()
    assignment = s.wait_generation(after=gen.number, timeout=10)
    assert assignment.rank == 1 and assignment.size == 2
    assert a.assignment().rank == 0  # the survivor keeps rank 0 (it holds the state)


def test_sigkill_member_expires_and_generation_forms_without_it(peers: Peers) -> None:
    (a,) = peers.start(1, min_np=1)
    proc = peers.spawn(min_np=1)
    victim = read_line(proc, "MEMBER").split()[1]
    gen, _ = wait_gen([a], lambda g: victim in g.roster)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    gen2, _ = wait_gen([a], lambda g: victim not in g.roster, timeout=15)
    assert gen2.number > gen.number and list(gen2.roster) == [a.member_id]
    assert victim in gen2.removed
    assert time.monotonic() - t0 < 3 * FAST["lease_ttl_s"] + 2


def test_silent_member_is_dropped_after_join_timeout_before_its_ttl(peers: Peers) -> None:
    settings = dict(min_np=1, lease_ttl_s=30, join_timeout_s=1.0)
    (a,) = peers.start(1, **settings)
    proc = peers.spawn(**settings)
    victim = read_line(proc, "MEMBER").split()[1]
    gen, _ = wait_gen([a], lambda g: victim in g.roster)
    read_line(proc, "GEN")
    os.kill(proc.pid, signal.SIGSTOP)  # alive (lease valid for 30 s) but silent
    t0 = time.monotonic()
    a.mark_broken(gen.number, "collective failed (test)")
    gen2, _ = wait_gen([a], lambda g: victim not in g.roster, timeout=10)
    took = time.monotonic() - t0
    assert "dropped" in gen2.reason and took < 10  # far below the 30 s TTL
    assert GenerationCause.GENERATION_CAUSE_DROPPED in gen2.causes
    # Its key went with the new generation (its lease is revoked too), long before the TTL...
    assert a.view.wait_for(lambda s: victim not in s.members, 10) is not None
    # ... and the leader does not re-admit it as a newcomer in the meantime.
    assert a.view.wait_for(lambda s: s.generation_number > gen2.number, 1.5) is None
    # Its lease was revoked: on SIGCONT it notices, re-registers as a new member and joins.
    os.kill(proc.pid, signal.SIGCONT)
    new_id = read_line(proc, "REJOINED").split()[1]
    assert new_id != victim
    wait_gen([a], lambda g: new_id in g.roster)


def test_dead_leader_is_replaced_within_join_timeout_not_its_ttl(peers: Peers) -> None:
    settings = dict(min_np=1, lease_ttl_s=30, join_timeout_s=1.0)
    proc = peers.spawn(**settings)  # the oldest member: the leader
    leader = read_line(proc, "MEMBER").split()[1]
    read_line(proc, "GEN")
    b, c = peers.start(2, **settings)
    gen, _ = wait_gen([b, c], lambda g: len(g.roster) == 3)
    assert list(gen.roster)[0] == leader
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    b.mark_broken(gen.number, "collective failed (test)")  # as the survivors' training would
    gen2, _ = wait_gen([b, c], lambda g: leader not in g.roster, timeout=15)
    took = time.monotonic() - t0
    assert took < 5, f"took {took:.1f} s: waited for the lease, not for proof of life"
    assert "dropped" in gen2.reason and list(gen2.roster) == [b.member_id, c.member_id]
    assert gen2.written_by == b.member_id  # the next-oldest took over


def test_racing_writers_exactly_one_generation_wins(peers: Peers) -> None:
    # A long settle_s: the real leader waits before acting on the joiner, so the test can
    # make both peers write the same next generation at once.
    a, b = peers.start(2, min_np=2, settle_s=30)
    wait_gen([a, b], lambda g: len(g.roster) == 2)
    peers.start(1, min_np=2, settle_s=30)
    for c in (a, b):
        c.view.wait_for(lambda s: len(s.members) == 3, 10)
    snap = a.snapshot()
    cfg = JobConfig()
    cfg.CopyFrom(snap.run.config)
    cfg.settle_s = 0
    plan = plan_next_generation(snap, cfg, set(), time.monotonic())
    assert not isinstance(plan, Wait)
    barrier = threading.Barrier(2)

    def write(c: Coordinator) -> None:
        barrier.wait()
        c.leader.write_generation(snap, plan, time.monotonic())

    threads = [threading.Thread(target=write, args=(c,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert a.counters.generations_written + b.counters.generations_written - 1 == 1
    assert a.counters.cas_lost + b.counters.cas_lost == 1
    kv = a.client.get(a.keys.generation)
    assert decode(GenerationRecord, kv.value).number == plan.number


def test_config_mismatch_names_both_values(peers: Peers) -> None:
    peers.start(1, min_np=2, max_np=4)
    with pytest.raises(ConfigError) as err:
        peers.start(1, min_np=3, max_np=4)
    msg = str(err.value)
    assert "min_np" in msg and "3" in msg and "2" in msg and "max_np" not in msg
    # Settings left unset are adopted from the job.
    client = EtcdClient(peers.endpoint)
    peers.clients.append(client)
    c = Coordinator(client, peers.job, JobSettings()).start()
    peers.coords.append(c)
    assert c.config.min_np == 2 and c.config.max_np == 4


def test_malformed_records_are_reported_and_ignored(peers: Peers, caplog) -> None:
    a, b = peers.start(2, min_np=2)
    gen, _ = wait_gen([a, b], lambda g: len(g.roster) == 2)
    k = a.keys
    junk = {
        k.member("intruder"): b"\x00\xffnot a protobuf",
        k.member("liar"): encode(MemberRecord(member_id="other", lease_id=1)),
        k.prefix + "gen/x/ready/y": b"zz",
        k.job_prefix + "stray": b"hello",
        k.prefix + "unknown/thing": b"",
    }
    for key, value in junk.items():
        a.client.put(key, value)
    (c,) = peers.start(1, min_np=2)  # the system keeps working around the junk
    gen2, _ = wait_gen([a, b, c], lambda g: len(g.roster) == 3)
    assert "intruder" not in gen2.roster and "liar" not in gen2.roster
    assert set(junk) <= set(a.view.malformed)
    a.client.put(k.generation, b"garbage")  # even the generation key
    (d,) = peers.start(1, min_np=2)
    wait_gen([a, b, c, d], lambda g: len(g.roster) == 4)


def test_elastic_timeout_fails_with_clear_error(peers: Peers) -> None:
    (a,) = peers.start(1, min_np=2, elastic_timeout_s=1.0)
    with pytest.raises(ElasticTimeout, match="min_np=2"):
        a.wait_generation(0, timeout=15)
    # The run is recorded as failed: a restarted or late peer does not wait all over again.
    with pytest.raises(ElasticTimeout, match="elastic timeout"):
        peers.start(1, min_np=2, elastic_timeout_s=1.0)


def test_drain_of_an_unknown_member_is_refused(peers: Peers) -> None:
    (a,) = peers.start(1)
    with pytest.raises(ConfigError, match="no member 'nobody'"):
        drain(a.client, peers.job, "nobody")


def test_reset_limit_stops_a_job_that_resets_too_often(peers: Peers) -> None:
    a, b = peers.start(2, min_np=1, reset_limit=1)
    wait_gen([a, b], lambda g: len(g.roster) == 2)
    b.close()  # reset 1: allowed
    wait_gen([a], lambda g: len(g.roster) == 1)
    peers.start(1, min_np=1, reset_limit=1)  # reset 2: over the limit
    with pytest.raises(ResetLimitExceeded, match="reset_limit=1"):
        a.wait_generation(a.latest_generation.number, timeout=15)


def test_done_ends_standbys_and_late_joiners(peers: Peers) -> None:
    a, s = peers.start(2, min_np=1, max_np=1)
    wait_gen([a, s], lambda g: len(g.roster) == 1)
    assert a.finish(success=True)
    assert not a.finish(success=False, reason="second writer loses")
    with pytest.raises(JobFinished) as err:
        s.wait_generation(0, timeout=10)
    assert err.value.success
    with pytest.raises(JobFinished):
        peers.start(1, min_np=1, max_np=1)


def test_job_name_reused_after_run_ends(peers: Peers) -> None:
    a, = peers.start(1, min_np=1, run_ttl_s=3, lease_ttl_s=2)
    first_run = a.run.run_id
    wait_gen([a], lambda g: True)
    a.finish(success=True)
    a.close()
    # The done record outlives the last peer by run_ttl, then the name is free again.
    deadline = time.monotonic() + 20
    while True:
        try:
            (b,) = peers.start(1, min_np=1, run_ttl_s=3, lease_ttl_s=2)
            break
        except JobFinished:
            assert time.monotonic() < deadline, "old run never expired"
            time.sleep(0.5)
    assert b.run.run_id != first_run
    wait_gen([b], lambda g: g.number == 1)
    # Nothing of the old run is left behind.
    kvs, _ = b.client.get_prefix(RunKeys(peers.job, first_run).prefix)
    assert kvs == []


def test_abandoned_run_does_not_trap_the_next(peers: Peers) -> None:
    settings = dict(min_np=1, run_ttl_s=2, lease_ttl_s=1)
    proc = peers.spawn(**settings)
    read_line(proc, "GEN")
    client = EtcdClient(peers.endpoint)
    peers.clients.append(client)
    run_key = JobKeys(peers.job).run_key
    old_run = client.get(run_key)
    assert old_run is not None
    os.kill(proc.pid, signal.SIGKILL)  # its only peer dies without cleaning up
    deadline = time.monotonic() + 20
    while client.get(run_key) is not None:  # the run lease runs out after run_ttl
        assert time.monotonic() < deadline, "abandoned run never expired"
        time.sleep(0.2)
    (b,) = peers.start(1, **settings)
    assert b.run.run_id not in old_run.value.decode("latin-1")
    wait_gen([b], lambda g: list(g.roster) == [b.member_id])


class _RunEndsAsItIsJoined(EtcdClient):
    """A client whose first successful transaction is followed by the revocation of
    ``run_lease``: the run's lease running out between a peer's registration and its first
    refresh, at the one moment that matters."""

    run_lease = 0

    def txn(self, compare, success=(), failure=()):  # noqa: ANN001, ANN201
        result = super().txn(compare, success, failure)
        if result[0] and self.run_lease:
            self.revoke(self.run_lease)
            self.run_lease = 0
        return result


def test_a_run_that_ends_as_a_peer_joins_it_is_left_for_a_new_run(peers: Peers) -> None:
    # A whole job died (SIGKILL); a peer restarted while its run's key still stood. The
    # run's lease ends right after the peer registered into it: the peer must start a run of
    # its own, not fail with "run disappeared" nor leave its member key behind.
    settings = dict(min_np=1, run_ttl_s=30)
    proc = peers.spawn(**settings)
    read_line(proc, "GEN")
    os.kill(proc.pid, signal.SIGKILL)
    client = _RunEndsAsItIsJoined(peers.endpoint)
    peers.clients.append(client)
    old = decode(RunRecord, client.get(JobKeys(peers.job).run_key).value, "run")
    client.run_lease = old.lease_id
    b = Coordinator(client, peers.job, JobSettings(**{**FAST, **settings}))
    peers.coords.append(b)
    b.start()
    assert client.run_lease == 0, "no registration transaction succeeded"
    assert b.run.run_id != old.run_id
    wait_gen([b], lambda g: list(g.roster) == [b.member_id])
    assert b.error is None
    kvs, _ = client.get_prefix(RunKeys(peers.job, old.run_id).prefix)
    assert [kv.key for kv in kvs if b.member_id in kv.key] == []


class _CountsRefreshes(EtcdClient):
    """A client that counts the refreshes of each lease it sends."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.refreshes: Counter[int] = Counter()

    def keepalive(self, lease_id, budget_s=None):  # noqa: ANN001, ANN201
        self.refreshes[lease_id] += 1
        return super().keepalive(lease_id, budget_s)

    def keepalive_many(self, lease_ids, budget_s=None):  # noqa: ANN001, ANN201
        self.refreshes.update(lease_ids)
        return super().keepalive_many(lease_ids, budget_s)


def test_the_run_lease_is_refreshed_once_an_interval_from_the_start(peers: Peers) -> None:
    # The peer that creates the run granted its lease, the one that joins refreshed it as
    # it registered (to know the run still stands): neither refreshes it again before an
    # interval (a third of run_ttl_s) has passed.
    coords = peers.start(2, client_type=_CountsRefreshes, min_np=1, run_ttl_s=60)
    wait_gen(coords, lambda g: len(g.roster) == 2)
    run_lease = coords[0].run.lease_id
    assert [c.client.refreshes[run_lease] for c in coords] == [0, 1]


def test_drain_removes_member_gracefully(peers: Peers) -> None:
    a, b = peers.start(2, min_np=1)
    gen, _ = wait_gen([a, b], lambda g: len(g.roster) == 2)
    drain(a.client, peers.job, b.member_id, "test")
    assert b.drain_requested.wait(10)
    gen2, _ = wait_gen([a, b], lambda g: b.member_id not in g.roster)
    assert "left" in gen2.reason and not gen2.joined
    assert list(gen2.causes) == [GenerationCause.GENERATION_CAUSE_LEFT]
    b.close()
    snap = a.view.wait_for(lambda s: b.member_id not in s.members, 10)
    assert snap.departures[-1].graceful


def test_lost_lease_rejoins_as_new_member(peers: Peers) -> None:
    a, b = peers.start(2, min_np=1)
    wait_gen([a, b], lambda g: len(g.roster) == 2)
    old = b.member_id
    a.client.revoke(b.lease_id)  # as if b had stalled past its TTL
    gen, _ = wait_gen([a, b], lambda g: old not in g.roster and len(g.roster) == 2)
    assert b.member_id != old and b.member_id in gen.roster
    assert b.assignment().rank == 1  # a joiner, never rank 0
    assert b.counters.rejoins == 1


def test_a_lost_lease_ends_the_registration_at_once_and_rejoins_when_the_gate_opens(
        peers: Peers) -> None:
    # The gate stands for "the training thread has left the lost registration's groups"
    # (GroupManager.left_lost_registration): until it opens, b must not be listed again, or
    # the others would wait for a thread still stuck in an old collective.
    a, b = peers.start(2, min_np=1)
    wait_gen([a, b], lambda g: len(g.roster) == 2)
    left = threading.Event()
    b.hold_rejoin(left.is_set)
    old, incarnation = b.member_id, b.incarnation
    a.client.revoke(b.lease_id)  # as if b had stalled past its TTL
    gen, _ = wait_gen([a], lambda g: g.roster == [a.member_id])
    deadline = time.monotonic() + 10
    while b.incarnation == incarnation:  # the training side sees LEASE_LOST without waiting
        assert time.monotonic() < deadline, "b never noticed its lost lease"
        time.sleep(0.05)
    assert b.mark_broken(gen.number, "no registration, no write") is False
    # Held: nobody lists b again however long it waits (several of a's settle periods).
    assert a.view.wait_for(lambda s: len(s.members) > 1, 2.0) is None
    assert b.counters.rejoins == 0 and b.member_id == old
    left.set()
    b.view.wake()  # what GroupManager.destroy does
    gen, _ = wait_gen([a, b], lambda g: len(g.roster) == 2)
    assert b.member_id != old and b.member_id in gen.roster
    assert b.counters.rejoins == 1 and b.incarnation == incarnation + 1


def test_a_paused_job_takes_back_its_only_member_after_its_lease_lapsed(peers: Peers) -> None:
    # Paused, the roster is frozen against joins; but the member comes back as a newcomer,
    # and without it the job has nobody to train (it would wait for a resume, or fail).
    (a,) = peers.start(1, min_np=1)
    wait_gen([a], lambda g: len(g.roster) == 1)
    update_config(a.client, peers.job, {"paused": True})
    a.view.wait_for(lambda s: s.run is not None and s.run.config.paused, 10)
    old = a.member_id
    a.client.revoke(a.lease_id)  # as if it had stalled past its TTL
    gen, _ = wait_gen([a], lambda g: a.member_id != old and list(g.roster) == [a.member_id])
    assert a.snapshot().run.config.paused  # still paused: only min_np was let in


def test_blacklist_excludes_a_failing_host_for_its_cooldown(peers: Peers) -> None:
    settings = dict(min_np=1, blacklist_after=1, blacklist_cooldown_s=3)
    (a,) = peers.start(1, host="good", **settings)
    (b,) = peers.start(1, host="flaky", **settings)
    wait_gen([a], lambda g: len(g.roster) == 2)
    b.rejoin.auto = False
    a.client.revoke(b.lease_id)  # a failure, not a graceful leave
    snap = a.view.wait_for(lambda s: "flaky" in s.blacklist, 10)
    assert snap is not None
    (c,) = peers.start(1, host="flaky", **settings)
    time.sleep(1.0)  # give the leader time to (wrongly) add it
    assert c.member_id not in a.latest_generation.roster
    wait_gen([a, c], lambda g: c.member_id in g.roster, timeout=15)  # after the cooldown


def test_shared_view_simulates_many_members_in_one_process(etcd: str, unique_job: str) -> None:
    client = EtcdClient(etcd)
    view = JobView(client, unique_job)
    coords = [Coordinator(client, unique_job, JobSettings(**FAST), view=view) for _ in range(16)]
    try:
        for c in coords:
            c.start()
        snap = view.wait_for(lambda s: s.generation is not None and len(s.generation.roster) == 16
                             and set(s.generation.roster) <= s.ready_for(s.generation.number), 20)
        assert snap is not None
        assert [c.assignment().rank for c in coords] == list(range(16))
    finally:
        for c in coords:
            c.close()
        client.close()


def test_members_sharing_a_keeper_keep_the_run_alive_when_one_closes(
        etcd: str, unique_job: str) -> None:
    """A process hosting several members refreshes the shared run lease once; one member
    closing must not stop the refresh for the others."""
    from peer_elastic.etcd.lease import LeaseKeeper

    client = EtcdClient(etcd)
    keeper = LeaseKeeper(client)
    view = JobView(client, unique_job)
    settings = JobSettings(**{**FAST, "run_ttl_s": 3})
    coords = [Coordinator(client, unique_job, settings, view=view, keeper=keeper).start()
              for _ in range(3)]
    try:
        assert keeper.scheduled(coords[0].run.lease_id) == 1
        coords[0].close()
        time.sleep(4.5)  # longer than run_ttl: only the refresh keeps the run alive
        for c in coords[1:]:
            c.check()
            assert c.snapshot().run is not None
        t0 = time.monotonic()
        coords[1].close()  # closing is prompt: no waiting for a coordination tick
        assert time.monotonic() - t0 < 1.0
    finally:
        for c in coords:
            c.close()
        keeper.stop()
        client.close()


def test_two_jobs_on_one_etcd_do_not_disturb_each_other(etcd: str, unique_job: str) -> None:
    """Job names where one is a prefix of the other: joins, a pause, a drain and a crash in
    one job leave the other's generations, settings and members untouched."""
    a_job, b_job = unique_job, unique_job + "-2"
    a_peers, b_peers = Peers(etcd, a_job), Peers(etcd, b_job)
    try:
        a1, a2 = a_peers.start(2)
        b1, b2 = b_peers.start(2)
        wait_gen([a1, a2], lambda g: len(g.roster) == 2)
        b_gen, _ = wait_gen([b1, b2], lambda g: len(g.roster) == 2)
        update_config(a1.client, a_job, {"paused": True, "max_np": 3})
        drain(a1.client, a_job, a2.member_id)
        wait_gen([a1], lambda g: g.roster == [a1.member_id])
        a1.close(leave=False)  # a crash-like exit of job a's leader
        a_peers.start(1)
        # Job b saw none of it: same generation, settings, members.
        snap = b1.snapshot()
        assert snap.generation.number == b_gen.number
        assert set(snap.members) == {b1.member_id, b2.member_id}
        assert not snap.run.config.paused and snap.run.config.max_np == b1.config.max_np
        assert not snap.drains and b1.error is None and b2.error is None
        with pytest.raises(ConfigError, match="has no member"):
            drain(b1.client, b_job, a2.member_id)  # a member of job a is not one of b's
    finally:
        a_peers.close()
        b_peers.close()


def test_a_view_whose_first_read_failed_starts_on_the_next_try(etcd: str,
                                                                unique_job: str) -> None:
    """A failed start() (etcd unreachable for its first read) leaves the view unstarted, so
    the next start() reads and watches instead of returning a view that never updates."""
    from peer_elastic.etcd.client import FaultInjection

    client = EtcdClient(etcd, retry_budget_s=0.5)
    view = JobView(client, unique_job)
    try:
        def unreachable(what: str) -> None:
            raise EtcdUnavailable(f"test: {what}")

        client.faults = FaultInjection(before=unreachable)
        with pytest.raises(EtcdUnavailable):
            view.start()
        client.faults = None
        view.start()
        version = view.snapshot().version
        client.put(JobKeys(unique_job).prefix + "test-key", b"x")  # any write under the job
        assert view.wait_change(version, timeout=20) != version
    finally:
        view.stop()
        client.close()
