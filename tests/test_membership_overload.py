"""Many members per process on an overloaded host settle, instead of rejoining forever.

A worker process hosts many :class:`Coordinator` objects sharing one client, view and lease
keeper (as ``benchmarks/bench_membership.py`` does). Once they registered, the test
overloads the worker for a while: busy Python threads that take the GIL whenever they can,
as a process's own busy threads do, so every keep-alive stream, watch delivery and ack is
late. What used to turn such a load into a loop at 1,024 members: keep-alive streams that
missed their deadline were retried whole, so the leases expired together; each rejoin was
a generation every member had to acknowledge, and every change woke every member's thread
(more load, more expiries). Here the overloaded worker must come out of it by itself: once
the load is gone, one generation lists every member, every member acked it, no live member
was dropped, and it stays that way.

With the code before that fix, this test's worker fell into the loop and did not come out
(on a 2-core machine: 1,580 rejoins in 3 minutes, never one settled generation); now it
settles in well under a minute with no rejoin.

Run as a module, this file is the worker: ``python -m tests.test_membership_overload
worker ENDPOINT JOB COUNT`` (settings from ``PEER_ELASTIC_*``; ``load``, ``unload`` and
``stats`` on stdin).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from peer_elastic.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = 256
SETTINGS = dict(start_settle_s=1.0, settle_s=0.05, lease_ttl_s=5, join_timeout_s=1.0,
                run_ttl_s=30)
#: Busy threads in the worker while it is overloaded (see ``_hog``), and for how long.
HOG_THREADS = 1
LOADED_S = 15.0
#: Members registering side by side in the worker.
REGISTERING_AT_ONCE = 16
SETTLE_TIMEOUT_S = 90.0  # generous: the machine may be loaded besides
STABLE_S = 5.0  # the settled generation must stay the newest this long


# --- the worker (a separate process) -------------------------------------------------------


def worker(endpoint: str, job: str, count: int) -> int:
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.etcd.lease import LeaseKeeper
    from peer_elastic.etcd.view import JobView

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    client = EtcdClient(endpoint, retry_budget_s=30)
    view = JobView(client, job).start()
    keeper = LeaseKeeper(client, name="overload-keeper")
    settings = JobSettings.from_env()
    unloaded = threading.Event()
    with ThreadPoolExecutor(REGISTERING_AT_ONCE) as pool:  # many peers starting at once
        coords = list(pool.map(
            lambda _: Coordinator(client, job, settings, host="starved", view=view,
                                  keeper=keeper).start(), range(count)))
    print("REGISTERED", flush=True)
    for line in sys.stdin:  # one command a line; EOF ends the worker
        if line.strip() == "load":
            for k in range(HOG_THREADS):
                threading.Thread(target=_hog, args=(unloaded,), name=f"hog-{k}",
                                 daemon=True).start()
        elif line.strip() == "unload":
            unloaded.set()
        elif line.strip() == "stats":
            stats = {k: sum(c.counters.as_dict()[k] for c in coords)
                     for k in coords[0].counters.as_dict()}
            stats["errors"] = sum(1 for c in coords if c.error is not None)
            stats["members"] = sorted(c.member_id for c in coords)
            print(json.dumps(stats), flush=True)
    unloaded.set()
    for c in coords:
        c.close()
    keeper.stop()
    view.stop()
    client.close()
    return 0


def _hog(until: threading.Event) -> None:
    """Busy Python code: holds the GIL whenever it can, as a process's own busy threads do
    (the other members' coordination threads, a data loader), until ``until`` is set."""
    while not until.is_set():
        sum(range(10_000))


# --- the test ------------------------------------------------------------------------------


def _settled(snap, count: int) -> bool:  # noqa: ANN001
    gen = snap.generation
    return (gen is not None and len(gen.roster) == count
            and set(gen.roster) == set(snap.members)
            and set(gen.roster) <= snap.ready_for(gen.number))


@pytest.mark.slow
@pytest.mark.alone  # 256 members on one etcd load both CPUs, and it times their leases
def test_an_overloaded_worker_of_256_members_settles(fresh_etcd: EtcdServer,
                                                      unique_job: str) -> None:
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.view import JobView

    etcd = fresh_etcd.endpoint

    env = dict(os.environ)
    env.update({f"PEER_ELASTIC_{k.upper().removesuffix('_S')}": str(v)
                for k, v in SETTINGS.items()})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_membership_overload", "worker", etcd, unique_job,
         str(MEMBERS)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = EtcdClient(etcd)
    view = JobView(client, unique_job).start()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = _readline(proc, timeout=SETTLE_TIMEOUT_S)
        assert line == "REGISTERED", line
        _command(proc, "load")
        time.sleep(LOADED_S)  # how long the overload lasts, not a synchronisation
        _command(proc, "unload")
        snap = view.wait_for(lambda s: _settled(s, MEMBERS), timeout=SETTLE_TIMEOUT_S)
        assert snap is not None, _describe(view.snapshot(), MEMBERS)
        settled = snap.generation.number
        # And it stays settled: no lease expires and nobody rejoins once the load is gone.
        changed = view.wait_for(lambda s: s.generation_number != settled
                                or set(s.members) != set(snap.members), timeout=STABLE_S)
        assert changed is None, _what_changed(snap, changed)
        stats = _stats(proc)
        assert stats["errors"] == 0
        assert stats["dropped"] == 0  # no live member was taken for dead
        assert sorted(snap.generation.roster) == stats["members"]
    finally:
        view.stop()
        client.close()
        _end(proc)


def test_which_changes_wake_members_that_do_not_write() -> None:
    from peer_elastic.etcd.keys import KeyKind
    from peer_elastic.etcd.view import wakes_followers

    # Acks, registrations and bookkeeping matter to the writer only ...
    for kind in (KeyKind.READY, KeyKind.ALIVE, KeyKind.MEMBER, KeyKind.EVENT,
                 KeyKind.PROGRESS, KeyKind.STATE):
        assert not wakes_followers(kind, deleted=False), kind
    # ... what can change a follower's part wakes it: a departure, a generation, a break.
    for kind in (KeyKind.GENERATION, KeyKind.BROKEN, KeyKind.DRAIN, KeyKind.FENCED,
                 KeyKind.RUN, KeyKind.DONE, KeyKind.BLACKLIST, KeyKind.UNREACHABLE):
        assert wakes_followers(kind, deleted=False), kind
    assert wakes_followers(KeyKind.MEMBER, deleted=True)
    assert not wakes_followers(KeyKind.READY, deleted=True)
    assert not wakes_followers(None, deleted=False)


def test_a_follower_waiter_sleeps_through_acks_and_wakes_for_a_departure(
        etcd: str, unique_job: str) -> None:
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.etcd.view import JobView, WakeOn

    client = EtcdClient(etcd)
    view = JobView(client, unique_job).start()
    settings = JobSettings(start_settle_s=0.1, settle_s=0.05, lease_ttl_s=3)
    coords = [Coordinator(client, unique_job, settings, view=view) for _ in range(2)]
    try:
        for c in coords:
            c.start()
        assert view.wait_for(lambda s: s.generation is not None and len(s.generation.roster) == 2
                             and set(s.generation.roster) <= s.ready_for(s.generation.number),
                             timeout=SETTLE_TIMEOUT_S)
        every = view.snapshot().version
        followers = view.wait_change(-1, 0.0, wake_on=WakeOn.FOLLOWER_CHANGE)
        coords[0].record_event("note", detail="bookkeeping, not membership")
        assert view.wait_change(every, SETTLE_TIMEOUT_S) != every  # the view saw it ...
        assert view.wait_change(followers, 0.0, wake_on=WakeOn.FOLLOWER_CHANGE) == followers
        coords[1].close()  # ... and a departure wakes everyone
        assert view.wait_change(followers, SETTLE_TIMEOUT_S,
                                wake_on=WakeOn.FOLLOWER_CHANGE) != followers
    finally:
        for c in coords:
            c.close()
        view.stop()
        client.close()


def test_a_keepalive_stream_cut_short_keeps_the_answers_it_got(etcd: str) -> None:
    """Real etcd: a stream whose deadline passes before every answer came returns the
    leases etcd answered (refreshed), leaves the others out, and raises only when none
    came."""
    from peer_elastic.errors import EtcdError
    from peer_elastic.etcd.client import EtcdClient

    granter = EtcdClient(etcd)
    leases = [granter.grant(30) for _ in range(400)]
    short = EtcdClient(etcd, timeout_s=0.02, retry_budget_s=0.0)  # a deadline few streams meet
    try:
        partial = None
        for _ in range(50):  # the deadline races the answers: find a round it cut short
            try:
                answers = short.keepalive_many(leases)
            except EtcdError:
                continue  # none came in time: the call fails, as before
            if len(answers) < len(leases):
                partial = answers
                break
        if partial is None:
            pytest.skip("no keep-alive round was cut short part way on this machine")
        assert partial and set(partial) < set(leases)
        assert all(ttl > 0 for ttl in partial.values())
    finally:
        for lease_id in leases:
            granter.revoke(lease_id)
        short.close()
        granter.close()


def test_the_ttls_of_many_leases_are_asked_in_one_call(etcd: str) -> None:
    """Real etcd: lease_ttls answers for every lease, -1 for the revoked and the unknown
    ones (a lease keeper confirms a round's lost leases with it)."""
    from peer_elastic.etcd.client import EtcdClient

    client = EtcdClient(etcd)
    leases = [client.grant(30) for _ in range(300)]
    try:
        client.revoke(leases[7])
        unknown = max(leases) + 12345
        ttls = client.lease_ttls([*leases, unknown])
        assert set(ttls) == {*leases, unknown}
        assert ttls[leases[7]] == -1 and ttls[unknown] == -1
        assert all(0 < ttls[i] <= 30 for i in leases if i != leases[7])
    finally:
        for lease_id in leases:
            client.revoke(lease_id)
        client.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the worker's output within ``timeout`` (a thread reads it: the pipe has
    no timeout of its own)."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not out:
        raise AssertionError(f"the worker said nothing within {timeout:.0f} s")
    return out[0].strip()


def _command(proc: subprocess.Popen, command: str) -> None:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def _stats(proc: subprocess.Popen) -> dict:
    _command(proc, "stats")
    return json.loads(_readline(proc, timeout=60))


def _describe(snap, count: int) -> str:  # noqa: ANN001
    gen = snap.generation
    if gen is None:
        return f"no generation; {len(snap.members)} members"
    acked = snap.ready_for(gen.number)
    return (f"generation {gen.number}: {len(gen.roster)} listed of {len(snap.members)} "
            f"members (want {count}), {len(acked & set(gen.roster))} acked")


def _what_changed(before, after) -> str:  # noqa: ANN001
    """How the view moved on from the settled snapshot ``before`` (a failure's message)."""
    gone = sorted(set(before.members) - set(after.members))
    came = sorted(set(after.members) - set(before.members))
    gen = after.generation
    if gen is None:
        return f"no generation after {before.generation.number}; gone {gone}, come {came}"
    moved = sorted(set(gen.roster) ^ set(before.generation.roster))
    return (f"after generation {before.generation.number} settled: members gone {gone}, "
            f"come {came}; now {_describe(after, len(before.members))}, causes "
            f"{list(gen.causes)} ({gen.reason!r}), roster change {moved}")


def _end(proc: subprocess.Popen) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)
    except (subprocess.TimeoutExpired, BrokenPipeError):
        proc.kill()
        proc.wait(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        sys.exit(worker(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else __file__} worker "
             "ENDPOINT JOB COUNT")
