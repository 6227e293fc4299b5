"""The roster planner, as a pure function of a view snapshot (no etcd)."""

from __future__ import annotations

from types import MappingProxyType

from peer_elastic.etcd.roster import (
    GenerationPlan,
    Wait,
    plan_next_generation,
    silence_deadline,
    silent_members,
)
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.records import (
    GenerationCause,
)
from tests.helpers.views import cfg, snap

C = GenerationCause


def test_first_generation_waits_for_stragglers_unless_full() -> None:
    s = snap(["a-1", "b-1"], changed_at=10.0)
    assert isinstance(plan_next_generation(s, cfg(min_np=2), set(), 10.5), Wait)
    p = plan_next_generation(s, cfg(min_np=2), set(), 11.5)
    assert isinstance(p, GenerationPlan) and p.roster == ("a-1", "b-1") and p.number == 1
    assert p.causes == (C.GENERATION_CAUSE_FIRST,)
    p = plan_next_generation(s, cfg(min_np=1, max_np=2), set(), 10.0)
    assert isinstance(p, GenerationPlan)


def test_below_min_np_waits() -> None:
    w = plan_next_generation(snap(["a-1"]), cfg(min_np=2), set(), 100)
    assert isinstance(w, Wait) and "min_np=2" in w.why


def test_survivors_keep_their_order_and_newcomers_never_take_rank_0() -> None:
    # c is older than b but only b was in the roster: b keeps rank 0 over newcomer c.
    s = snap(["c-1", "b-1", "d-1"], gen=(4, ["b-1", "x-1"]))
    p = plan_next_generation(s, cfg(), set(), 100)
    assert p.roster == ("b-1", "c-1", "d-1")
    assert p.joined == ("c-1", "d-1") and p.removed == ("x-1",)
    assert p.causes == (C.GENERATION_CAUSE_EXPIRED, C.GENERATION_CAUSE_JOINED)


def test_max_np_makes_standbys_and_promotes_them() -> None:
    s = snap(["a-1", "b-1", "c-1"], gen=(1, ["a-1", "b-1"]))
    assert isinstance(plan_next_generation(s, cfg(max_np=2), set(), 100), Wait)
    s = snap(["a-1", "c-1"], gen=(1, ["a-1", "b-1"]))
    p = plan_next_generation(s, cfg(max_np=2), set(), 100)
    assert p.roster == ("a-1", "c-1") and p.joined == ("c-1",)


def test_removals_only_write_the_survivors_and_a_broken_generation_its_same_roster() -> None:
    s = snap(["a-1"], gen=(3, ["a-1", "b-1"]))
    p = plan_next_generation(s, cfg(), set(), 100)
    assert p.roster == ("a-1",) and not p.broken
    s = snap(["a-1", "b-1"], gen=(3, ["a-1", "b-1"]), broken=["a-1"])
    p = plan_next_generation(s, cfg(), set(), 0.0)  # broken: no settle wait
    assert p.roster == ("a-1", "b-1") and p.broken and p.number == 4
    assert p.causes == (C.GENERATION_CAUSE_BROKEN,)


def test_silent_members_are_dropped_at_once() -> None:
    s = snap(["a-1", "b-1", "c-1"], gen=(2, ["a-1", "b-1", "c-1"]), ready=["a-1", "c-1"],
             changed_at=99.99)
    silent = silent_members(s, seen_at=90.0, join_timeout_s=1.0, now=100.0)
    assert silent == {"b-1": "ready"}
    assert silent_members(s, seen_at=99.5, join_timeout_s=1.0, now=100.0) == {}
    p = plan_next_generation(s, cfg(), silent, 100.0)
    assert p.roster == ("a-1", "c-1") and p.dropped == ("b-1",) and "dropped" in p.reason
    assert p.causes == (C.GENERATION_CAUSE_DROPPED,)


def test_drained_and_blacklisted_members_are_not_eligible() -> None:
    s = snap(["a-1", "b-1", "bad-1"], gen=(1, ["a-1", "b-1", "bad-1"]), drains=["b-1"],
             blacklist=["bad"])
    p = plan_next_generation(s, cfg(), set(), 100)
    assert p.roster == ("a-1",) and set(p.removed) == {"b-1", "bad-1"}


def test_joins_settle_before_a_generation_is_written() -> None:
    s = snap(["a-1", "b-1"], gen=(1, ["a-1"]), changed_at=100.0)
    w = plan_next_generation(s, cfg(settle_s=0.5), set(), 100.1)
    assert isinstance(w, Wait) and w.until == 100.5


def test_paused_job_forms_nothing() -> None:
    c = cfg()
    c.paused = True
    assert isinstance(plan_next_generation(snap(["a-1"]), c, set(), 100), Wait)


def test_a_paused_job_lets_newcomers_in_only_up_to_min_np() -> None:
    # Its only member's lease lapsed while paused; it came back as b-2: without it the job
    # could not train until resumed (or would fail at the elastic timeout).
    c = cfg(min_np=1)
    c.paused = True
    p = plan_next_generation(snap(["b-2", "c-1"], gen=(5, [])), c, set(), 100)
    assert isinstance(p, GenerationPlan) and p.roster == ("b-2",) and p.joined == ("b-2",)
    # At min_np, nobody more: the roster stays frozen against growth.
    s = snap(["a-1", "c-1"], gen=(5, ["a-1"]))
    assert isinstance(plan_next_generation(s, c, set(), 100), Wait)
    c2 = cfg(min_np=2)
    c2.paused = True
    s = snap(["a-1", "b-2", "c-1"], gen=(5, ["a-1"]))
    p = plan_next_generation(s, c2, set(), 100)
    assert isinstance(p, GenerationPlan) and p.roster == ("a-1", "b-2")


def test_silence_is_not_counted_while_etcd_was_disrupted() -> None:
    s = snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1"]), ready=["a-1"])
    # Seen at 90, now 100: b is silent, unless etcd was disrupted (an election, a failing
    # request) until 99.5, in which case b gets join_timeout from then.
    assert silent_members(s, seen_at=90.0, join_timeout_s=1.0, now=100.0) == {"b-1": "ready"}
    assert silent_members(s, 90.0, 1.0, 100.0, settled_at=99.5) == {}
    assert silent_members(s, 90.0, 1.0, 100.6, settled_at=99.5) == {"b-1": "ready"}


def test_silence_starts_join_timeout_after_the_later_of_the_ack_owed_and_the_floor() -> None:
    assert silence_deadline(90.0, floor=0.0, join_timeout_s=1.0) == 91.0
    assert silence_deadline(90.0, floor=99.5, join_timeout_s=1.0) == 100.5
    # The leader's next look is the moment silent_members first names the member.
    s = snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1"]), ready=["a-1"])
    for seen_at, settled_at in ((0.1, 0.0), (0.1, 10.3), (7.7, 0.0)):
        at = silence_deadline(seen_at, settled_at, 10.2)
        assert silent_members(s, seen_at, 10.2, at, settled_at) == {"b-1": "ready"}
        assert silent_members(s, seen_at, 10.2, at - 1e-6, settled_at) == {}


def test_whether_the_roster_lacks_an_ack_counts_members_whose_key_is_gone() -> None:
    # c's key is gone: not_ready leaves it out (nobody waits on a member that left), but
    # the roster still lacks its ack, and that is what a follower's silence clock is for.
    s = snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1", "c-1"]), ready=["a-1", "b-1"])
    assert s.not_ready() == () and s.roster_lacks_ready()
    assert not snap(["a-1"], gen=(2, ["a-1"]), ready=["a-1"]).roster_lacks_ready()
    assert not snap(["a-1"]).roster_lacks_ready() and not snap(["a-1"]).roster_lacks_alive()
    # b marked generation 2 broken itself: not_alive does not wait on it; the roster still
    # lacks its "alive".
    s = snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1"]), ready=["a-1", "b-1"], broken=["b-1"],
             alive=["a-1"])
    assert s.not_alive() == () and s.roster_lacks_alive()
    assert not snap(["a-1", "b-1"], gen=(2, ["a-1", "b-1"]), broken=["b-1"],
                    alive=["a-1", "b-1"]).roster_lacks_alive()


def test_a_dead_leader_is_found_by_its_missing_alive_ack() -> None:
    # Everyone acked generation 3 long ago; then it broke (b's collective failed). The dead
    # leader a never answers "alive": it is silent, and the next-oldest can drop it.
    s = snap(["a-1", "b-1", "c-1"], gen=(3, ["a-1", "b-1", "c-1"]),
             ready=["a-1", "b-1", "c-1"], broken=["b-1"])
    s = ViewSnapshot(**{**s.__dict__, "alive": MappingProxyType({3: frozenset({"c-1"})})})
    assert silent_members(s, 10.0, 1.0, 100.0, broken_seen_at=99.5) == {}
    assert silent_members(s, 10.0, 1.0, 100.6, broken_seen_at=99.5) == {"a-1": "alive"}
    p = plan_next_generation(s, cfg(), {"a-1": "alive"}, 100.6)
    assert p.roster == ("b-1", "c-1") and p.dropped == ("a-1",)


def test_departures_below_min_np_write_a_waiting_generation() -> None:
    # b left (SIGTERM) from a 2-peer job with min_np=2: everyone stops, the leaver can go.
    s = snap(["a-1"], gen=(4, ["a-1", "b-1"]))
    p = plan_next_generation(s, cfg(min_np=2), {}, 100)
    assert isinstance(p, GenerationPlan) and p.roster == () and p.number == 5
    assert "waiting" in p.reason and p.removed == ("b-1",)
    assert p.causes == (C.GENERATION_CAUSE_BELOW_MIN_NP, C.GENERATION_CAUSE_EXPIRED)
    # From the waiting generation nothing more happens until enough peers are there ...
    s = snap(["a-1"], gen=(5, []))
    assert isinstance(plan_next_generation(s, cfg(min_np=2), {}, 100), Wait)
    # ... and then everyone joins, the oldest (the state holder) first.
    s = snap(["a-1", "c-1"], gen=(5, []))
    p = plan_next_generation(s, cfg(min_np=2), {}, 100)
    assert p.roster == p.joined == ("a-1", "c-1")


def test_roster_is_capped_by_its_byte_budget_and_the_reason_says_so() -> None:
    from peer_elastic.etcd.roster import roster_bytes

    members = [f"host{i:02d}-1" for i in range(20)]  # 9 bytes each, 12 with framing
    s = snap(members, changed_at=0.0)
    p = plan_next_generation(s, cfg(min_np=1), set(), 5.0, roster_budget=12 * 5)
    assert isinstance(p, GenerationPlan)
    assert p.roster == tuple(members[:5])  # the oldest that fit; the rest are standbys
    assert roster_bytes(p.roster) <= 12 * 5
    assert "roster capped at 5 members" in p.reason and "15 more" in p.reason
    assert p.causes == (C.GENERATION_CAUSE_FIRST, C.GENERATION_CAUSE_CAPPED)


def test_reasons_name_a_few_members_and_count_the_rest() -> None:
    members = [f"host{i:02d}-1" for i in range(30)]
    s = snap(members, gen=(1, members[:2]), ready=members[:2], changed_at=0.0)
    p = plan_next_generation(s, cfg(min_np=1), set(), 5.0)
    assert isinstance(p, GenerationPlan) and len(p.joined) == 28
    assert "joined: host02-1,host03-1," in p.reason and "(+20 more)" in p.reason
    assert len(p.reason) < 200


def test_departures_say_whether_a_member_left_expired_or_no_longer_fits() -> None:
    # b drained (a graceful leave), c's key ended without one, e is live but max_np=2 cuts it.
    s = snap(["a-1", "b-1", "d-1", "e-1"], gen=(2, ["a-1", "b-1", "c-1", "d-1", "e-1"]),
             drains=["b-1"])
    p = plan_next_generation(s, cfg(max_np=2), set(), 100)
    assert p.roster == ("a-1", "d-1") and p.removed == ("b-1", "c-1", "e-1")
    assert "left: b-1,c-1,e-1" in p.reason
    assert p.causes == (C.GENERATION_CAUSE_LEFT, C.GENERATION_CAUSE_EXPIRED,
                        C.GENERATION_CAUSE_RESIZED)
