"""Members cut off from the others' process groups (peer_elastic/etcd/reach.py): the rule that
picks who goes, the reporter that keeps a report true, the record, and the view and roster
that act on it; the reporter against a fake etcd and against a real one (real coordinators,
whose leader writes the generations). The real thing on the network (three hosts, one cut off from the others but not from etcd)
is tests/test_partition.py::test_peer_cut_off_from_its_peers_but_not_etcd_is_left_out_until_it_heals.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import replace
from types import MappingProxyType

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import RecordError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.reach import ReachReporter, cut_off
from peer_elastic.etcd.roster import plan_next_generation
from peer_elastic.records import GenerationCause, ReachRecord, decode, encode
from tests.helpers.views import cfg, snap

AGE = ["a", "b", "c", "d", "e"]  # oldest first


# -- the rule -------------------------------------------------------------------------------------


def test_a_member_alone_on_the_far_side_of_a_cut_goes_even_the_oldest() -> None:
    reports = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}
    assert cut_off(reports, AGE[:3]) == {"a"}


def test_one_sided_reports_are_enough() -> None:
    # Only the others managed to report (the cut-off member's etcd write failed).
    assert cut_off({"b": {"c"}, "a": {"c"}}, AGE[:3]) == {"c"}


def test_of_two_equal_halves_the_one_with_the_oldest_member_stays() -> None:
    reports = {"a": {"c", "d"}, "b": {"c", "d"}, "c": {"a", "b"}, "d": {"a", "b"}}
    assert cut_off(reports, AGE[:4]) == {"c", "d"}


def test_two_members_that_cannot_reach_each_other_keep_the_older() -> None:
    assert cut_off({"a": {"b"}, "b": {"a"}}, AGE[:2]) == {"b"}


def test_a_lone_first_report_takes_out_the_member_it_names_not_its_writer() -> None:
    # a (the oldest) is cut off from b and c. b's report reaches etcd first: a single edge,
    # on which a is the one reported. Then the others arrive; a goes throughout.
    assert cut_off({"b": {"a"}}, AGE[:3]) == {"a"}
    assert cut_off({"b": {"a"}, "c": {"a"}}, AGE[:3]) == {"a"}
    assert cut_off({"b": {"a"}, "a": {"b", "c"}}, AGE[:3]) == {"a"}
    # And the other way round: a younger member reported by an older one goes.
    assert cut_off({"a": {"c"}}, AGE[:3]) == {"c"}


def test_a_healing_cut_keeps_out_the_member_that_was_out_not_the_one_that_trained() -> None:
    # a (the oldest) was cut off from b and c; b, c trained on without it (roster b, c).
    # The cut heals and the reports go one by one: c withdrew, a no longer names c. The last
    # edge, a <-> b, must keep a out (it is out already), not take b out of a training roster.
    assert cut_off({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}, AGE[:3], ["b", "c"]) == {"a"}
    assert cut_off({"a": {"b"}, "b": {"a"}}, AGE[:3], ["b", "c"]) == {"a"}
    assert cut_off({"a": {"b"}}, AGE[:3], ["b", "c"]) == {"a"}
    # Both in the roster (or both out): the older stays, as before.
    assert cut_off({"a": {"b"}, "b": {"a"}}, AGE[:3], ["a", "b", "c"]) == {"b"}
    assert cut_off({"a": {"b"}, "b": {"a"}}, AGE[:3], ["c"]) == {"b"}
    # The most edges still decide first: out of the roster or not.
    assert cut_off({"b": {"a", "c"}, "a": {"b"}, "c": {"b"}}, AGE[:3], ["b", "c"]) == {"b"}


def test_dead_members_and_unknown_names_are_ignored() -> None:
    # "z" is no live member (its key is gone); a report by a dead member counts for nothing.
    assert cut_off({"a": {"z"}, "z": {"a", "b"}}, AGE[:3]) == frozenset()
    assert cut_off({}, AGE) == frozenset()


def test_a_member_never_cuts_itself_off_by_naming_itself() -> None:
    assert cut_off({"a": {"a"}}, AGE[:2]) == frozenset()


@pytest.mark.parametrize("seed", range(40))
def test_what_stays_can_reach_itself_and_the_rule_is_deterministic(seed: int) -> None:
    rng = random.Random(seed)
    live = AGE[: rng.randint(2, 5)]
    reports = {m: {o for o in live if o != m and rng.random() < 0.3} for m in live}
    gone = cut_off(reports, live)
    stays = [m for m in live if m not in gone]
    assert stays, "somebody always stays"
    for m in stays:
        assert not (reports[m] & set(stays)), (reports, gone)
    # Whatever order the reports come in, the same members go (every member agrees).
    shuffled = dict(sorted(reports.items(), key=lambda _: rng.random()))
    assert cut_off(shuffled, live) == gone
    # With any roster, too: what stays is still mutually reachable, and deterministic.
    roster = [m for m in live if rng.random() < 0.6]
    gone = cut_off(reports, live, roster)
    stays = [m for m in live if m not in gone]
    assert stays and all(not (reports[m] & set(stays)) for m in stays), (reports, roster, gone)
    assert cut_off(shuffled, live, list(reversed(roster))) == gone


# -- the record ------------------------------------------------------------------------------------


def test_the_record_round_trips_and_is_validated() -> None:
    rec = ReachRecord(member_id="a", unreachable=["b", "c"], generation=4, unix=1.0)
    back = decode(ReachRecord, encode(rec), "k")
    assert list(back.unreachable) == ["b", "c"] and back.generation == 4
    for bad in (ReachRecord(member_id="a", unreachable=[]),
                ReachRecord(member_id="a", unreachable=["a"]),
                ReachRecord(member_id="a", unreachable=["b", "b"]),
                ReachRecord(member_id="a", unreachable=["x/y"]),
                ReachRecord(member_id="../a", unreachable=["b"])):
        with pytest.raises(RecordError):
            decode(ReachRecord, encode(bad), "k")


# -- the reporter ----------------------------------------------------------------------------------


class FakeEtcd:
    """The reporter's writes and the answers its probes get."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.record: frozenset[str] | None = None
        self.writes: list[frozenset[str] | None] = []
        self.down: set[str] = set()

    def write(self, members: frozenset[str], generation: int) -> None:
        with self.cond:
            self.record = members
            self.writes.append(members)
            self.cond.notify_all()

    def erase(self) -> None:
        with self.cond:
            self.record = None
            self.writes.append(None)
            self.cond.notify_all()

    def probe(self, member: str) -> str | None:
        with self.cond:
            return "no answer" if member in self.down else None

    def wait(self, want: frozenset[str] | None, timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.record == want, timeout)


def test_a_report_is_written_at_once_and_withdrawn_as_members_answer() -> None:
    etcd = FakeEtcd()
    etcd.down = {"b", "c"}
    rep = ReachReporter(etcd.write, etcd.erase, etcd.probe, reprobe_s=0.02)
    rep.report(3, ["b", "c"])
    assert etcd.record == {"b", "c"}  # written on the caller's thread
    with etcd.cond:
        etcd.down.discard("b")
    assert etcd.wait(frozenset({"c"}))
    with etcd.cond:
        etcd.down.clear()
    assert etcd.wait(None)
    assert rep.reported == frozenset()
    # A new report after it went quiet starts re-probing again.
    with etcd.cond:
        etcd.down = {"d"}
    rep.report(4, ["d"])
    assert etcd.record == {"d"}
    with etcd.cond:
        etcd.down.clear()
    assert etcd.wait(None)
    rep.close()


def test_reports_add_up_and_close_erases_the_record() -> None:
    etcd = FakeEtcd()
    etcd.down = {"b", "c"}
    rep = ReachReporter(etcd.write, etcd.erase, etcd.probe, reprobe_s=0.02)
    rep.report(1, ["b"])
    rep.report(1, ["b"])  # nothing new: no write
    rep.report(2, ["c"])
    assert etcd.writes == [frozenset({"b"}), frozenset({"b", "c"})]
    rep.close()
    assert etcd.record is None
    rep.report(3, ["b"])  # closed: ignored
    assert etcd.record is None


def test_close_without_erasing_leaves_the_record_to_its_lease() -> None:
    etcd = FakeEtcd()
    etcd.down = {"b"}
    rep = ReachReporter(etcd.write, etcd.erase, etcd.probe, reprobe_s=0.02)
    rep.report(1, ["b"])
    rep.close(erase=False)
    assert etcd.record == {"b"}


# -- the view and the roster -----------------------------------------------------------------------


def test_the_roster_leaves_out_the_cut_off_member_and_says_why() -> None:
    reports = {"a-1": frozenset({"c-1"}), "b-1": frozenset({"c-1"}),
               "c-1": frozenset({"a-1", "b-1"})}
    s = replace(snap(["a-1", "b-1", "c-1"], gen=(2, ["a-1", "b-1", "c-1"])),
                unreachable=MappingProxyType(reports))
    assert s.cut_off() == {"c-1"}
    assert [m.id for m in s.eligible()] == ["a-1", "b-1"]
    plan = plan_next_generation(s, cfg(min_np=2), set(), 100)
    assert plan.roster == ("a-1", "b-1") and plan.removed == ("c-1",)
    assert plan.causes == (GenerationCause.GENERATION_CAUSE_UNREACHABLE,)
    assert "cut off from the others' process groups" in plan.reason
    # The reports withdrawn (the cut healed), it is eligible again: it joins.
    s = snap(["a-1", "b-1", "c-1"], gen=(3, ["a-1", "b-1"]))
    plan = plan_next_generation(s, cfg(min_np=2), set(), 100)
    assert plan.roster == ("a-1", "b-1", "c-1") and plan.joined == ("c-1",)


# -- the same on a real etcd, with real coordinators (their leader writes the generations) --------


@contextlib.contextmanager
def three_coordinators(etcd: str, job: str, min_np: int) -> Iterator[list[Coordinator]]:
    """Three started coordinators of ``job``, each on its own client; all closed after."""
    fast = JobSettings(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0,
                       min_np=min_np)
    made: list[tuple[Coordinator, EtcdClient]] = []
    try:
        for _ in range(3):
            client = EtcdClient(etcd)
            made.append((Coordinator(client, job, fast).start(), client))
        yield [coord for coord, _ in made]
    finally:
        for coord, client in made:
            coord.close()
            client.close()


def test_reports_in_etcd_take_a_member_out_and_their_withdrawal_brings_it_back(
        etcd: str, unique_job: str) -> None:
    from peer_elastic.etcd.admin import status_document

    with three_coordinators(etcd, unique_job, min_np=2) as (a, b, c):

        def roster(size: int) -> tuple[str, ...]:
            snap = a.view.wait_for(lambda s: s.generation is not None
                                   and len(s.generation.roster) == size, 30)
            assert snap is not None, f"no generation of {size}"
            return tuple(snap.generation.roster)

        assert set(roster(3)) == {a.member_id, b.member_id, c.member_id}
        down = {c.member_id}  # what the probes cannot reach, as the real ones would say
        lock = threading.Lock()

        def probe(member: str) -> str | None:
            with lock:
                return "no answer" if member in down else None

        reporters = [ReachReporter(lambda ms, n, k=k: k.report_unreachable(ms, n),
                                   k.clear_unreachable, probe, reprobe_s=0.05) for k in (a, b)]
        n = a.snapshot().generation_number
        for rep in reporters:
            rep.report(n, [c.member_id])
        assert set(roster(2)) == {a.member_id, b.member_id}
        snap = a.snapshot()
        assert GenerationCause.GENERATION_CAUSE_UNREACHABLE in snap.generation.causes
        assert snap.cut_off() == {c.member_id}
        doc = status_document(unique_job, snap, now=0.0)
        shown = {m["id"]: (m["cut_off"], m["unreachable"]) for m in doc["members"]}
        assert shown[c.member_id] == (True, [])
        assert shown[a.member_id] == (False, [c.member_id])
        with lock:
            down.clear()  # the cut heals: the reporters withdraw, c is admitted again
        assert set(roster(3)) == {a.member_id, b.member_id, c.member_id}
        assert not a.snapshot().unreachable
        for rep in reporters:
            rep.close()


def test_closing_a_reporter_in_etcd_erases_its_record_or_leaves_it_to_the_lease(
        etcd: str, unique_job: str) -> None:
    # The two closes of the fake-etcd tests above, on a real etcd with real coordinators.
    with three_coordinators(etcd, unique_job, min_np=1) as (a, b, c):
        n = a.snapshot().generation_number
        reporters = {k.member_id: ReachReporter(
            lambda ms, g, k=k: k.report_unreachable(ms, g), k.clear_unreachable,
            lambda member: "no answer", reprobe_s=60.0) for k in (a, b)}
        for rep in reporters.values():
            rep.report(n, [c.member_id])
        both = a.view.wait_for(lambda s: set(s.unreachable) == {a.member_id, b.member_id}, 10)
        assert both is not None, a.snapshot().unreachable
        reporters[a.member_id].close()  # erases a's record at once
        assert a.view.wait_for(lambda s: set(s.unreachable) == {b.member_id}, 10) is not None
        reporters[b.member_id].close(erase=False)  # b's record stays while b's lease lives
        assert a.snapshot().unreachable.keys() == {b.member_id}
        b.close()  # its lease revoked: the record goes with it
        assert a.view.wait_for(lambda s: not s.unreachable, 10) is not None
