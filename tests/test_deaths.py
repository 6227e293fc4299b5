"""Deaths confirmed by a refused probe: who probes whom, the prober, and the leader's use of
them on a fake clock (no etcd; one real socket for the refusal)."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace
from types import MappingProxyType

from peer_elastic.etcd.deaths import (
    Death,
    DeathProber,
    ProbeTarget,
    all_gone,
    missing_acks,
    probe_targets,
    probeable,
    refused,
    refusing,
)
from peer_elastic.etcd.leader import Leader
from peer_elastic.etcd.roster import plan_next_generation, silent_members
from peer_elastic.etcd.view import Member, ViewSnapshot
from peer_elastic.process.probe_listener import ProbeListener
from peer_elastic.records import MemberRecord
from tests.helpers import views
from tests.helpers.fakes import FakeWrites


def snap(members, roster, **kw) -> ViewSnapshot:  # noqa: ANN001, ANN003
    """Generation 3 of ``roster``, its members on probe ports, a 20 s join timeout."""
    return views.snap(members, (3, roster), **{"ports": True, "join_timeout_s": 20.0, **kw})


ALL = ["a-1", "b-1", "c-1", "d-1"]


def dead(*ids: str) -> dict[str, Death]:
    return {m: Death(m, "127.0.0.1:1", "connection refused", 0.0) for m in ids}


def test_missing_acks_are_ready_or_alive_after_a_break() -> None:
    s = snap(ALL, ALL, ready=["a-1", "b-1", "c-1"])
    assert missing_acks(s) == ["d-1"]
    # Broken by b: b answered by marking; c answered alive; a and d owe "alive".
    s = snap(ALL, ALL, ready=ALL, broken=["b-1"], alive=["c-1"])
    assert missing_acks(s) == ["a-1", "d-1"]


def test_only_the_next_in_line_probes_a_missing_leader() -> None:
    s = snap(ALL, ALL, ready=ALL, broken=["c-1"], alive=["b-1", "d-1"])  # a (leader) silent
    assert [t.member_id for t in probe_targets(s, "b-1", {})] == ["a-1"]
    assert probe_targets(s, "c-1", {}) == []  # b answered: b writes, not c
    assert probe_targets(s, "d-1", {}) == []
    # a confirmed dead: b is the writer and has nothing else to probe.
    assert probe_targets(s, "b-1", dead("a-1")) == []


def test_the_writer_probes_every_missing_member_and_a_chain_of_dead_elders_is_walked() -> None:
    s = snap(ALL, ALL, ready=["a-1", "c-1"])  # b and d missing "ready"
    assert [t.member_id for t in probe_targets(s, "a-1", {})] == ["b-1", "d-1"]
    # c's next elder b owes an ack: c probes it (b might be dead and c next in line after
    # a's...); d's next elder c answered: d stops there.
    assert [t.member_id for t in probe_targets(s, "c-1", {})] == ["b-1"]
    assert probe_targets(s, "d-1", {}) == []
    s = snap(ALL, ALL, ready=["c-1", "d-1"])  # a and b missing
    assert [t.member_id for t in probe_targets(s, "c-1", {})] == ["b-1"]
    assert [t.member_id for t in probe_targets(s, "c-1", dead("b-1"))] == ["a-1"]
    assert [t.member_id for t in probe_targets(s, "c-1", dead("a-1", "b-1"))] == []
    assert probe_targets(s, "d-1", {}) == []


def test_members_without_a_probe_port_are_never_probed() -> None:
    s = snap(ALL, ALL, ready=["a-1"], ports=False)
    assert probe_targets(s, "a-1", {}) == []


def test_a_loopback_address_is_probed_only_from_a_loopback_address() -> None:
    # A peer on another host that advertises ::1 by mistake: my own ::1 would refuse.
    s = snap(ALL, ALL, ready=["a-1", "b-1", "c-1"])
    remote = dict(s.members)
    for m, addr in (("a-1", "10.0.0.1"), ("b-1", "10.0.0.2"), ("c-1", "10.0.0.3"), ("d-1", "::1")):
        remote[m] = Member(MemberRecord(member_id=m, host=m.split("-")[0], lease_id=1,
                                        net_address=addr, probe_port=5000),
                           s.members[m].create_revision, 1)
    s = replace(s, members=MappingProxyType(remote), by_age=tuple(remote.values()))
    assert probe_targets(s, "a-1", {}) == []
    assert [t.member_id for t in probe_targets(snap(ALL, ALL, ready=["a-1"]), "a-1", {})] \
        == ["b-1", "c-1", "d-1"]  # all on 127.0.0.1: one host


def test_probeable_applies_the_same_rules_to_any_members() -> None:
    # What a rank stuck forming a group probes (Reachability.why_forming_is_stuck).
    s = snap(ALL, ALL)
    assert [t.member_id for t in probeable(s, "a-1", s.members.values())] \
        == ["b-1", "c-1", "d-1"]  # never itself
    assert [(t.address, t.port) for t in probeable(s, "a-1", [s.members["c-1"]])] \
        == [("127.0.0.1", 5002)]
    assert probeable(snap(ALL, ALL, ports=False), "a-1", s.members.values()) == []
    # From a member whose key is gone (not on loopback as far as anyone knows): no loopback.
    assert probeable(s, "gone-1", s.members.values()) == []


def test_a_confirmed_death_is_silent_at_once_only_while_it_owes_an_ack() -> None:
    s = snap(ALL, ALL, ready=ALL, broken=["c-1"], alive=["b-1"])
    assert silent_members(s, 0.0, 20.0, 1.0, broken_seen_at=0.5) == {}
    assert silent_members(s, 0.0, 20.0, 1.0, broken_seen_at=0.5,
                          deaths=dead("a-1")) == {"a-1": "alive"}
    # c marked the break (it was alive then): a refusal later does not drop it here.
    assert silent_members(s, 0.0, 20.0, 1.0, broken_seen_at=0.5, deaths=dead("c-1")) == {}
    s = snap(ALL, ALL, ready=["a-1", "b-1", "c-1"])
    assert silent_members(s, 0.0, 20.0, 0.1, deaths=dead("d-1")) == {"d-1": "ready"}
    assert silent_members(s, 0.0, 20.0, 0.1, deaths=dead("b-1")) == {}  # b acked


def test_the_plan_names_the_evidence() -> None:
    s = snap(ALL, ALL, ready=ALL, broken=["c-1"], alive=["b-1", "d-1"])
    p = plan_next_generation(s, s.run.config, {"a-1": "alive"}, 1.0, deaths=dead("a-1"))
    assert p.roster == ("b-1", "c-1", "d-1") and p.dropped == ("a-1",)
    assert "dropped: a-1 (process gone: connection refused at 127.0.0.1:1)" in p.reason
    assert "join_timeout" not in p.reason


def test_the_leader_drops_a_dead_leader_long_before_join_timeout_on_the_fake_clock() -> None:
    s = snap(ALL, ALL, ready=ALL, broken=["c-1"], alive=["b-1", "d-1"])
    w = FakeWrites("b-1")
    lb = Leader("job", w, wall=lambda: 1000.0)
    lb.step(s, 100.0)
    assert w.calls == []  # a is not silent before join_timeout (20 s): b does not write
    lb.step(s, 100.05, dead("a-1"))
    assert w.calls == [("generation", 4, ("b-1", "c-1", "d-1"), 1000.0), ("revoke", 10)]
    # Another member (not next in line) does nothing with the same evidence.
    wc = FakeWrites("c-1")
    Leader("job", wc, wall=lambda: 1000.0).step(s, 100.05, dead("a-1"))
    assert wc.calls == []


def test_a_closed_listener_is_refused_an_open_one_is_not() -> None:
    listener = ProbeListener("127.0.0.1")
    port = listener.port
    assert refused("127.0.0.1", port) is None
    listener.close()
    assert refused("127.0.0.1", port) == "connection refused"


def test_a_stopped_process_is_no_proof_a_backlog_accepts() -> None:
    # A socket that listens but never accepts (a SIGSTOPped process): the kernel completes
    # the handshake, so the probe succeeds and proves nothing.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        assert refused("127.0.0.1", s.getsockname()[1]) is None


def test_all_gone_needs_a_refusal_from_every_member_it_is_asked_about() -> None:
    # Real sockets: c's listener is closed (its process gone), b's listens (alive or stopped).
    alive = ProbeListener("127.0.0.1")
    gone = ProbeListener("127.0.0.1")
    gone.close()
    targets = [ProbeTarget("b-1", "127.0.0.1", alive.port),
               ProbeTarget("c-1", "127.0.0.1", gone.port)]
    try:
        assert [t.member_id for t, _ in refusing(targets)] == ["c-1"]
        (death,) = all_gone(targets, ["c-1"])
        assert death.member_id == "c-1" and death.endpoint == f"127.0.0.1:{gone.port}"
        assert "connection refused" in death.describe()
        assert all_gone(targets, ["b-1", "c-1"]) is None  # b answered: no proof for both
        assert all_gone(targets, ["c-1", "d-1"]) is None  # d has no probe port to ask
        assert all_gone(targets, []) is None
    finally:
        alive.close()


def test_the_prober_confirms_wakes_and_forgets_departed_members() -> None:
    woke = threading.Event()
    answers = {5000: None, 5003: "connection refused"}
    prober = DeathProber(on_confirmed=woke.set, probe=lambda a, p: answers.get(p),
                         interval_s=0.01, clock=lambda: 7.0)
    try:
        prober.update(snap(ALL, ALL, ready=ALL), "a-1")
        assert not prober.started  # nothing to probe: no thread
        s = snap(ALL, ALL, ready=["b-1", "c-1"])  # a and d missing; a is the writer
        prober.update(s, "a-1")
        assert woke.wait(10)
        assert prober.confirmed() == {"d-1": Death("d-1", "127.0.0.1:5003",
                                                   "connection refused", 7.0)}
        assert prober.version == 1
        gone = snap(ALL[:3], ALL[:3], ready=["b-1", "c-1"])
        prober.update(gone, "a-1")
        assert prober.confirmed() == {}
    finally:
        prober.stop()
