"""A real network partition: one peer cut off from etcd, but not from its training peers.

Topology (tests/helpers/netns.py): two peers on the host, one in a network namespace joined
to the host by two veth links. Every peer's gloo traffic goes over one link
(GLOO_SOCKET_IFNAME); the namespace's peer reaches etcd only over the other link, which the
test cuts with a silent drop and later heals. Expected: the cut-off peer loses its lease and
stops training (but keeps running), the other two re-form a world of 2 and go on; after the
heal the cut-off peer rejoins as a new member, and the job ends with every sample counted
exactly once, every rank bit-identical and no process left behind. It is run twice: with
the leader cut off, and with a follower cut off.

The converse, a peer cut off from the other peers but not from etcd, runs on three hosts
(tests/helpers/hosts.py): its lease lives on, so only the members' reachability reports
(peer_elastic/etcd/reach.py) can take it out of the roster until the cut heals.

A roster host cut off from etcd only, while a standby on another host replaces its peer
(``max_np=2``, three hosts): the cut-off peer's last batch must end before the new group's
first batch begins (every batch timestamped on the machine's one monotonic clock), and after
the heal it registers again and the job ends exactly once. With both roster peers on the cut
host nothing they can reach tells them their leases ended, and they train on beside the new
group: that case is an expected failure until they stop by themselves.

Needs root and network namespaces; skipped (with the reason) where they are unavailable.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import job_prefix
from peer_elastic.testing import EtcdCluster, EtcdTestServer
from tests.helpers.hosts import hosts_or_skip
from tests.helpers.netns import Netns, NetnsUnavailable, tcp_connections, unavailable_reason
from tests.helpers.procs import Cluster, PeerProc, assert_exactly_once
from tests.helpers.worker_lines import (
    gens,
    steps,
    wait_for,
    wait_gen,
    wait_joined,
    wait_steps_in,
)

pytestmark = pytest.mark.slow

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    # Long enough that the test also passes where the survivors do not abandon a collective
    # with the cut-off peer early but wait for it to time out.
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 30,
    "PEER_ELASTIC_MIN_NP": 2,
    "PEER_ELASTIC_LOG_LEVEL": "INFO",  # member ids, leases and rejoins are read from the log
    "WORKER_EPOCHS": 2,
    "WORKER_SAMPLES": 2400,  # the job must outlast the cut and the rejoin by a wide margin
    "WORKER_STEP_S": 0.03,
}
HOLD_STEPS = 10  # STEP lines the world of 2 prints while the cut-off peer must stay quiet
LOST_LEASE = re.compile(r"lost its lease|after losing its lease")


@pytest.fixture
def netns() -> Iterator[Netns]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"partition test: {reason}")
    try:
        ns = Netns().create()  # cleans up after itself if it fails
    except NetnsUnavailable as exc:
        pytest.skip(f"partition test: {exc}")
    try:
        yield ns
    finally:
        ns.close()


@pytest.fixture
def etcd_on_link(netns: Netns) -> Iterator[EtcdTestServer]:
    """Our own etcd: on 127.0.0.1 for host peers, and on the etcd link for the namespace."""
    with EtcdTestServer(name="partition", extra_client_hosts=[netns.etcd.host_ip]) as server:
        yield server


@pytest.fixture
def cluster(etcd_on_link: EtcdTestServer, unique_job: str, tmp_path: Path) -> Iterator[Cluster]:
    # Epochs without end, ended by END_FILE once the test saw what it must (end_job): the job
    # outlasts the cut and the rejoin however slow the machine, and stops right after.
    c = Cluster(etcd_on_link.endpoint, unique_job, **{
        **SETTINGS, "WORKER_EPOCHS": 1000, "WORKER_SAMPLES": 960,
        "WORKER_END_FILE": str(tmp_path / "end")})
    try:
        yield c
    finally:
        c.close()  # SIGKILLs every peer still running, the namespace's one included


def start_ns_peer(cluster: Cluster, netns: Netns, etcd: EtcdTestServer) -> PeerProc:
    """An elastic worker inside the namespace: etcd over the etcd link, gloo over the other."""
    env = dict(cluster.env, PEER_ELASTIC_ETCD=f"http://{netns.etcd.host_ip}:{etcd.client_port}",
               GLOO_SOCKET_IFNAME=netns.gloo.ns_if, PEER_ELASTIC_HOST=netns.name)
    # Forked into the namespace (or `ip netns exec`'d, which execs it): the PID PeerProc kills
    # is the worker's own.
    p = PeerProc([sys.executable, "-m", "tests.helpers.elastic_worker"], env, "ns-peer",
                 forked=True, place=netns.place)
    cluster.peers.append(p)
    return p


@pytest.mark.parametrize("cut", ["leader", "follower"])
def test_peer_cut_off_from_etcd_loses_its_lease_stops_and_rejoins(
    netns: Netns, etcd_on_link: EtcdTestServer, cluster: Cluster, cut: str
) -> None:
    t0 = time.monotonic()
    host_env = {"GLOO_SOCKET_IFNAME": netns.gloo.host_if}
    # The first peer to register is the oldest member, i.e. the leader and rank 0: make that
    # the namespace's peer or a host peer, so that each role is cut deterministically.
    if cut == "leader":
        c = start_ns_peer(cluster, netns, etcd_on_link)
        wait_joined(c)
        a, b = cluster.start(2, **host_env)
    else:
        (a,) = cluster.start(1, **host_env)
        wait_joined(a)
        (b,) = cluster.start(1, **host_env)
        c = start_ns_peer(cluster, netns, etcd_on_link)
    old_member, old_lease = wait_joined(c)

    # 1. A world of 3 trains.
    _, g3 = wait_gen(c, 3)
    wait_steps_in(c, 3, g3)
    rank_c = next(r for _, g, r, _ in gens(c) if g == g3)
    assert (rank_c == 0) == (cut == "leader"), c.output()
    # The wiring is what the test claims: the namespace's peer talks to etcd over the etcd
    # link only, and to its training peers over the gloo link; host peers use the gloo link.
    conns = tcp_connections(c.pid)
    assert any(li == netns.etcd.ns_ip and ri == netns.etcd.host_ip
               and rp == etcd_on_link.client_port for li, _, ri, rp in conns), conns
    assert all(rp == etcd_on_link.client_port for _, _, ri, rp in conns
               if ri == netns.etcd.host_ip), f"only etcd may use the etcd link: {conns}"
    assert any(li == netns.gloo.ns_ip and ri == netns.gloo.host_ip
               for li, _, ri, _ in conns), f"no gloo connection on the gloo link: {conns}"
    for p in (a, b):
        assert any(li == netns.gloo.host_ip and ri == netns.gloo.ns_ip
                   for li, _, ri, _ in tcp_connections(p.pid)), tcp_connections(p.pid)

    # 2. Cut the namespace off from etcd: the other two re-form a world of 2 without it.
    marks = {p.name: len(p.lines) for p in (a, b, c)}
    netns.cut_etcd()
    t_cut = time.monotonic()
    _, g2 = wait_gen(a, 2, after=marks[a.name], timeout=90)
    wait_gen(b, 2, after=marks[b.name], timeout=30)
    wait_steps_in(a, 3, g2)
    wait_steps_in(b, 3, g2)
    t_reformed = time.monotonic()
    # The cut-off peer lost its lease: etcd has neither the lease nor its member key...
    with EtcdClient(etcd_on_link.endpoint) as client:
        assert client.lease_ttl(old_lease) == -1, "the cut-off peer's lease is still alive"
        kvs, _ = client.get_prefix(job_prefix(cluster.env["PEER_ELASTIC_JOB"]))
        assert not [kv.key for kv in kvs if kv.key.endswith(f"/members/{old_member}")], kvs
    # ...and it stopped training, but not running, while the other two go on.
    quiet_from = steps(c)
    wait_steps_in(a, 3 + HOLD_STEPS, g2)
    assert steps(c) == quiet_from, "the cut-off peer went on training:\n" + c.output()
    assert c.proc.poll() is None, "the cut-off peer must stay up to rejoin:\n" + c.output()
    assert g2 not in [g for _, g, _, _ in gens(c)], "the cut-off peer cannot be in the new world"

    # 3. Heal: the namespace's peer finds its lease gone and rejoins as a new member.
    netns.heal_etcd()
    t_heal = time.monotonic()
    i_rejoin, g_rejoin = wait_gen(c, 3, after=marks[c.name], timeout=120)
    assert g_rejoin > g2
    wait_gen(a, 3, after=marks[a.name], timeout=30)
    t_rejoined = time.monotonic()
    with c.cond:
        assert any(LOST_LEASE.search(line) for line in c.lines[marks[c.name]:i_rejoin]), \
            c.output()
    new_member, _ = wait_joined(c, after=marks[c.name], timeout=5)
    assert new_member != old_member
    wait_steps_in(c, 2, g_rejoin)

    # 4. The job finishes: every sample once, every rank identical, no process left behind.
    Path(cluster.env["WORKER_END_FILE"]).touch()
    result = assert_exactly_once([a, b, c], timeout=180)
    assert result["world"] == 3, result
    assert netns.pids() == [], "processes left inside the namespace"
    print(f"partition ({cut} cut, {netns.cut_mode}): world of 3 after {t_cut - t0:.1f} s, "
          f"cut -> world of 2 in {t_reformed - t_cut:.1f} s, heal -> world of 3 in "
          f"{t_rejoined - t_heal:.1f} s, job done after {time.monotonic() - t0:.1f} s")


# -- the other way round: cut off from the other peers, not from etcd --------------------------

PEER_CUT_SETTINGS = dict(
    SETTINGS,
    # The cut-off peer keeps its lease, so the collective in flight at the cut may wait this
    # long; the probes of a long wait (Reachability.waited_on_peers) usually end it sooner
    # (about 12 s), not always (see the assertion).
    PEER_ELASTIC_COLLECTIVE_TIMEOUT=20,
    WORKER_SAMPLES=960,
    WORKER_EPOCHS=1000,  # ended by WORKER_END_FILE once the cut-off peer is back
)


def test_peer_cut_off_from_its_peers_but_not_etcd_is_left_out_until_it_heals(
        unique_job: str, tmp_path) -> None:
    # Three hosts, one peer each; the leader's host loses the other hosts but keeps etcd
    # (the bridge): the oldest member is the one that must go, and someone else leads.
    # Its peer keeps its lease, so only the reachability reports can take it out: the other
    # two must re-form a world of 2 and train on (at 3 hosts it was measured to stall every
    # peer until the cut healed), and after the heal it must come back into a world of 3.
    end = tmp_path / "end"
    with hosts_or_skip(3, "peer cut") as hosts:
        etcd = EtcdCluster(1, extra_client_hosts=[hosts.bridge_ip4]).start()
        c = Cluster(etcd.endpoint_string, unique_job, **PEER_CUT_SETTINGS, WORKER_END_FILE=end)
        try:
            bridged = ",".join(f"{hosts.bridge_ip4}:{m.client_port}" for m in etcd.members)
            peers = []
            for h in hosts.hosts:  # one at a time: the first is the oldest (rank 0, leader)
                (p,) = c.start(1, place=h.place, where=h.name, PEER_ELASTIC_ETCD=bridged)
                wait_joined(p)
                peers.append(p)
            for p in peers:
                wait_gen(p, 3)
            victim = 0  # the oldest: rank 0 and the leader
            others = [p for i, p in enumerate(peers) if i != victim]
            try:
                hosts.cut_from_peers(hosts.hosts[victim])
            except NetnsUnavailable as exc:
                pytest.skip(f"peer cut: {exc}")
            cut_at = time.monotonic()
            seen = [len(p.lines) for p in others]
            for p, after in zip(others, seen, strict=True):
                _, g = wait_gen(p, 2, after=after, timeout=90)
                wait_steps_in(p, HOLD_STEPS, g, timeout=60)
            took = time.monotonic() - cut_at
            print(f"world of 2 trained {took:.1f} s after the cut")
            # The contract: the others train on without the cut-off peer, at worst after the
            # collective timeout. The stall probes end the wait first: 12.0-13.7 s in 16 runs
            # (8 under two busy loops) since a send gloo had queued on the cut link gets room
            # to complete before the cut (GroupConnections.cut); before, 3 runs of 14 waited
            # for the timeout.
            assert took < 20 + 30, (f"{took:.1f} s after the cut\n" + "\n".join(
                f"--- {p.name}\n{p.output()[-4000:]}" for p in peers))
            logs = "".join(p.output() for p in peers)
            assert "cut off from the others' process groups" in logs, logs[-3000:]
            seen = [len(p.lines) for p in peers]
            hosts.heal(hosts.hosts[victim])
            for p, after in zip(peers, seen, strict=True):
                wait_gen(p, 3, after=after, timeout=90)
            end.touch()
            assert_exactly_once(peers, timeout=180)
        finally:
            c.close()
            etcd.stop()


# -- a roster host cut off from etcd, replaced by a standby on another host --------------------

STANDBY_SETTINGS = dict(
    SETTINGS,
    PEER_ELASTIC_MIN_NP=1,
    PEER_ELASTIC_MAX_NP=2,  # the third peer waits as a standby
    WORKER_SAMPLES=960,
    WORKER_EPOCHS=1000,  # ended by WORKER_END_FILE once the cut-off peers are back
    WORKER_STEP_TIMES=1,  # every batch says when it ran: STEPPED lines
)
STEPPED_LINE = re.compile(r"STEPPED (\d+) (\d+) (\d+) (\d+\.\d+) (\d+\.\d+)")


def stepped(p: PeerProc, upto: int | None = None) -> list[tuple[int, float, float]]:
    """(generation, began, ended) of every batch ``p`` printed (in its first ``upto``
    lines, if given); times are ``time.monotonic()`` of the peer, the test's clock too."""
    with p.cond:
        lines = p.lines if upto is None else p.lines[:upto]
        return [(int(m.group(3)), float(m.group(4)), float(m.group(5))) for line in lines
                if (m := STEPPED_LINE.fullmatch(line))]


class TwoGroupsTrained(AssertionError):
    """A cut-off peer's batch of its old group was still running when the new group's first
    batch began."""


def assert_one_group_at_a_time(cut_off: list[PeerProc], others: list[PeerProc], g_new: int,
                               t_cut: float) -> tuple[int, float, float]:
    """Every batch the ``cut_off`` peers ran in a generation before ``g_new`` ended before
    the first batch the ``others`` ran in a later generation than those began. Returns (the
    cut-off peers' last generation, when their last batch ended, when the new group's first
    batch began). Raises :class:`TwoGroupsTrained` otherwise."""
    old = [(g, ended) for p in cut_off for g, _, ended in stepped(p) if g < g_new]
    g_old = max(g for g, _ in old)
    last_old = max(ended for _, ended in old)
    first_new = min(began for p in others for g, began, _ in stepped(p) if g > g_old)
    if last_old >= first_new:
        raise TwoGroupsTrained(
            f"two groups trained at once: a cut-off peer's batch of generation {g_old} ended "
            f"{last_old - t_cut:.3f} s after the cut, the new group's first batch began "
            f"{first_new - t_cut:.3f} s after it\n" + "\n".join(
                f"--- {p.name}\n{p.output()[-3000:]}" for p in cut_off + others))
    return g_old, last_old, first_new


# Roster peers' hosts, standbys' hosts (indexes into hosts.hosts); host 0 is the one cut off.
# spread: one roster peer on the cut host, the other on a host that keeps etcd; the new group
# is that peer and the standby. together: both roster peers on the cut host, which can still
# train with each other there (their traffic never leaves it), so only their leases can stop
# them; the new group is the standby alone (which finds no holder of the newest state).
LAYOUTS = {
    "spread": ([0, 1], [2]),
    "together": pytest.param(([0, 0], [1]), marks=pytest.mark.xfail(
        raises=TwoGroupsTrained, strict=True,
        reason="peers that lose etcd keep training while their group holds: losing etcd is "
               "taken for an etcd outage (leases are restored when it returns), so they train "
               "on past the end of their leases, beside the group that replaced them")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_roster_host_cut_off_from_etcd_stops_before_its_standby_starts(
        unique_job: str, tmp_path: Path, layout: tuple[list[int], list[int]]) -> None:
    # max_np=2: two roster peers and a standby, on the hosts LAYOUTS names. The oldest
    # roster peer's host is cut off from etcd only (a tc filter that drops what goes to or
    # comes from the bridge's addresses, where etcd listens; the hosts still reach each
    # other). Its peers lose their leases and stop (spread: the other roster peer, told by
    # etcd, abandons the group, which stops the cut-off one); the others, with the standby,
    # form a new group. Two groups training at once would break exactly-once: every batch the cut-off
    # peers ran must have ended before the new group's first batch began, on one clock (the
    # machine's monotonic clock, which network namespaces share). After the heal the cut-off
    # peers register again (as standbys or in the roster) and the job ends exactly once.
    roster_at, standby_at = layout
    end = tmp_path / "end"
    with hosts_or_skip(3, "etcd cut with a standby") as hosts:
        etcd = EtcdCluster(1, extra_client_hosts=[hosts.bridge_ip4]).start()
        c = Cluster(etcd.endpoint_string, unique_job, **STANDBY_SETTINGS, WORKER_END_FILE=end)
        try:
            bridged = ",".join(f"{hosts.bridge_ip4}:{m.client_port}" for m in etcd.members)

            def start_on(i: int) -> PeerProc:
                h = hosts.hosts[i]
                (p,) = c.start(1, place=h.place, where=h.name, PEER_ELASTIC_ETCD=bridged)
                wait_joined(p)  # one at a time: the first is the oldest (rank 0, leader)
                return p

            roster = [start_on(i) for i in roster_at]
            for p in roster:
                wait_gen(p, 2)
            standbys = [start_on(i) for i in standby_at]
            cut_off = [p for p, i in zip(roster, roster_at, strict=True) if i == 0]
            survivors = [p for p in roster if p not in cut_off] + standbys
            # The roster trains on with the standby registered, and the standby does not train.
            base = len(stepped(roster[0]))
            wait_for(roster[0], lambda: True if len(stepped(roster[0])) >= base + 10 else None,
                     "no 10 batches with the standby registered")
            assert not any(gens(s) for s in standbys), "a standby trained:\n" + \
                "\n".join(s.output() for s in standbys)
            # The wiring the cut relies on: the cut-off peers reach etcd at the bridge's
            # address (which the cut drops) and the other roster peer at its host's (which it
            # spares).
            partner_ip = hosts.hosts[roster_at[1]].ip4
            for p in cut_off:
                conns = tcp_connections(p.pid)
                assert any(ri == hosts.bridge_ip4 for _, _, ri, _ in conns), conns
                assert any(ri == partner_ip for _, _, ri, _ in conns), conns

            marks = {p.name: len(p.lines) for p in c.peers}
            t_cutting = time.monotonic()
            try:
                hosts.cut_from_etcd(hosts.hosts[0])
            except NetnsUnavailable as exc:
                pytest.skip(f"etcd cut with a standby: {exc}")
            t_cut = time.monotonic()

            # The others form a new group, the standby in it, and train on.
            size = min(len(survivors), 2)
            g_new = 0
            for p in survivors:
                _, g = wait_gen(p, size, after=marks[p.name], timeout=120)
                g_new = max(g_new, g)
            wait_for(standbys[0], lambda: True if sum(
                1 for g, _, _ in stepped(standbys[0]) if g >= g_new) >= HOLD_STEPS else None,
                f"the new group (generation {g_new}) did not train {HOLD_STEPS} batches",
                timeout=90)
            # No overlap so far: the cut-off peers' last batch of their old group ended
            # before the new group's first began (checked again once every line is in).
            assert_one_group_at_a_time(cut_off, survivors, g_new, t_cut)
            # The cut-off peers stopped training, but not running (that they lost their
            # leases they can only say once they reach etcd again: after the heal).
            quiet = {p.name: len(stepped(p)) for p in cut_off}
            wait_for(standbys[0], lambda: True if sum(
                1 for g, _, _ in stepped(standbys[0]) if g >= g_new) >= 2 * HOLD_STEPS
                else None, f"the new group did not train {2 * HOLD_STEPS} batches", timeout=90)
            for p in cut_off:
                assert len(stepped(p)) == quiet[p.name], "a cut-off peer trained on:\n" + \
                    p.output()
                assert p.proc.poll() is None, "a cut-off peer must stay up:\n" + p.output()

            # Heal: the cut-off peers find their leases gone and register again as new
            # members (as standbys or in the roster); the job ends once.
            hosts.heal(hosts.hosts[0])
            for p in cut_off:
                wait_joined(p, after=marks[p.name], timeout=120)
                # Said in a line of its own, just after the registration's.
                wait_for(p, lambda p=p: True if any(
                    LOST_LEASE.search(line) for line in p.lines[marks[p.name]:]) else None,
                    "registered again without saying it lost its lease", timeout=30)
            end.touch()
            result = assert_exactly_once(c.peers, timeout=180)
            assert result["world"] <= 2, result
            g_old, last_old, first_new = assert_one_group_at_a_time(
                cut_off, survivors, g_new, t_cut)  # every line read: the peers exited
            print(f"etcd cut ({len(cut_off)} of 2 roster peers): cut took "
                  f"{t_cut - t_cutting:.2f} s; cut -> last batch of the cut-off peers ended "
                  f"{last_old - t_cut:.2f} s; cut -> first "
                  f"batch of the new group began {first_new - t_cut:.2f} s "
                  f"(generation {g_old} -> {g_new})")
        finally:
            c.close()
            etcd.stop()
