"""The rendezvous' commit point (peer_elastic.torch.barrier) on a real etcd: every member
goes on, or none does, whenever each one gives up."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.torch.barrier import Arrival, BarrierResult, pass_barrier
from peer_elastic.torch.store import EtcdStore

MEMBERS = ("m0", "m1", "m2")


def arrivals(unique_job: str, n: int) -> str:
    return RunKeys(unique_job, "run0").arrivals_prefix(n)


def pass_as(client: EtcdClient, prefix: str, me: str, members: tuple[str, ...] = MEMBERS,
            abort_at: float | None = None, timeout_s: float = 30.0) -> BarrierResult:
    """``me`` passes the barrier; its abort() gives a reason from ``abort_at``
    (time.monotonic()) on."""
    def abort() -> str | None:
        if abort_at is not None and time.monotonic() >= abort_at:
            return "superseded (test)"
        return None

    with EtcdStore(client, prefix, abort=abort) as store:
        return pass_barrier(store, me, members, timedelta(seconds=timeout_s))


def test_everyone_arriving_commits(client: EtcdClient, unique_job: str) -> None:
    prefix = arrivals(unique_job, 1)
    with ThreadPoolExecutor(len(MEMBERS)) as pool:
        results = list(pool.map(lambda m: pass_as(client, prefix, m), MEMBERS))
    assert [r.arrival for r in results] == [Arrival.COMMITTED] * len(MEMBERS)
    # Alone, a member commits at once.
    assert pass_as(client, arrivals(unique_job, 2), "m0", ("m0",)).arrival is Arrival.COMMITTED


def test_giving_up_before_everyone_arrived_withdraws_for_good(client: EtcdClient,
                                                              unique_job: str) -> None:
    prefix = arrivals(unique_job, 1)
    first = pass_as(client, prefix, "m0", abort_at=time.monotonic() + 0.3)
    assert first.arrival is Arrival.ABANDONED and "superseded" in first.detail
    assert client.get(prefix + "m0") is None  # withdrawn
    # The others arrive later: nobody can commit without m0, and they time out.
    with ThreadPoolExecutor(2) as pool:
        rest = list(pool.map(lambda m: pass_as(client, prefix, m, timeout_s=1.0), MEMBERS[1:]))
    assert [r.arrival for r in rest] == [Arrival.TIMED_OUT] * 2, rest
    assert "m0" in rest[0].detail
    kvs, _ = client.get_prefix(prefix)
    assert kvs == []


def test_giving_up_after_everyone_arrived_still_commits(client: EtcdClient,
                                                        unique_job: str) -> None:
    prefix = arrivals(unique_job, 1)
    for m in MEMBERS[1:]:
        client.put(prefix + m, b"")
    # Superseded before it even arrived: its withdrawal finds everyone there.
    late = pass_as(client, prefix, "m0", abort_at=time.monotonic())
    assert late.arrival is Arrival.COMMITTED
    assert client.get(prefix + "m0") is not None


@pytest.mark.parametrize("seed", range(3))
def test_every_member_commits_or_none_does(client: EtcdClient, unique_job: str,
                                           seed: int) -> None:
    """Members arrive at random moments and give up at random moments (or never):
    whatever the interleaving, the outcome is all-committed or none-committed."""
    rng = random.Random(seed)
    members = tuple(f"m{i}" for i in range(4))
    committed_rounds = 0
    for round_ in range(8):
        prefix = arrivals(unique_job, round_ + 1)
        start = threading.Barrier(len(members))
        plan = {m: (rng.uniform(0, 0.05), rng.choice([None, rng.uniform(0, 0.1)]))
                for m in members}

        def member(m: str, prefix: str = prefix, start: threading.Barrier = start,
                   plan: dict = plan) -> Arrival:
            delay, give_up = plan[m]
            start.wait()
            t0 = time.monotonic()
            time.sleep(delay)  # arrival order is the point of the test
            abort_at = None if give_up is None else t0 + give_up
            # Where someone gives up, the others' timeouts are part of the play: keep them short.
            timeout_s = 5.0 if all(g is None for _, g in plan.values()) else 1.0
            return pass_as(client, prefix, m, members, abort_at, timeout_s).arrival

        with ThreadPoolExecutor(len(members)) as pool:
            got = tuple(pool.map(member, members))
        committed = got.count(Arrival.COMMITTED)
        assert committed in (0, len(members)), (round_, plan, got)
        if all(give_up is None for _, give_up in plan.values()):
            assert committed == len(members), (round_, plan, got)
        committed_rounds += committed > 0
    print(f"seed {seed}: {committed_rounds} of 8 rounds committed")


def test_a_withdrawal_retried_after_its_answer_was_lost_still_withdraws(
        client: EtcdClient, unique_job: str) -> None:
    """The client retries a transaction whose answer was lost. If the first attempt
    withdrew and the last member arrived before the retry, the retry must not report a
    commit: its own key is gone, and the others wait for it."""
    prefix = arrivals(unique_job, 1)
    with EtcdStore(client, prefix) as store:
        store.set("m0", b"")
        assert store.delete_unless_all_exist("m0", ["m1", "m2"])  # the first attempt
        for m in ("m1", "m2"):
            store.set(m, b"")
        assert store.delete_unless_all_exist("m0", ["m1", "m2"])  # the retry: still gone
        assert client.get(prefix + "m0") is None
        # Whereas with its key and every other there, it stays: the barrier committed.
        store.set("m0", b"")
        assert not store.delete_unless_all_exist("m0", ["m1", "m2"])
