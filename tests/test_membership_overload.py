"""Hundreds of members per process on a starved host settle, instead of rejoining forever.

A worker process hosts many :class:`Coordinator` objects sharing one client, view and lease
keeper (as ``benchmarks/bench_membership.py`` does). While they register and for a while
after, the test starves the worker: SIGSTOP / SIGCONT in turns, so the process gets a
fraction of the time it asks for and every keep-alive stream, watch delivery and ack is
late. Before the fixes this test goes with, such a worker fell into a loop: its
keep-alive streams missed their deadlines whole, the leases expired together, the
members rejoined, every rejoin was a new generation that all members had to acknowledge
(more load, more expiries). Now a starved worker only converges later: once the starving
stops, one generation lists every member, every member acked it, and it stays that way.

Run as a module, this file is the worker: ``python -m tests.test_membership_overload
worker ENDPOINT JOB COUNT`` (settings from ``PEER_ELASTIC_*``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = 256
#: join_timeout_s above the stops: a process stopped longer than that is taken for hung
#: by design; what is tested here is a process that is slow, not one that hangs.
SETTINGS = dict(start_settle_s=0.5, settle_s=0.05, lease_ttl_s=5, join_timeout_s=10.0,
                run_ttl_s=30)
#: Starving: stopped this long, then running this long, over and over. A keep-alive
#: stream has a 2 s deadline: one that does not finish within a running turn misses it.
STOPPED_S, RUNNING_S = 1.5, 0.5
#: How long the worker stays starved once every member registered.
STARVED_S = 15.0
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
    with ThreadPoolExecutor(REGISTERING_AT_ONCE) as pool:  # many peers starting at once
        coords = list(pool.map(
            lambda _: Coordinator(client, job, settings, host="starved", view=view,
                                  keeper=keeper).start(), range(count)))
    print("REGISTERED", flush=True)
    for line in sys.stdin:  # one command a line; EOF ends the worker
        if line.strip() == "stats":
            stats = {k: sum(c.stats[k] for c in coords) for k in coords[0].stats}
            stats["errors"] = sum(1 for c in coords if c.error is not None)
            stats["members"] = sorted(c.member_id for c in coords)
            print(json.dumps(stats), flush=True)
    for c in coords:
        c.close()
    keeper.stop()
    view.stop()
    client.close()
    return 0


# --- the test ------------------------------------------------------------------------------


class Starver:
    """SIGSTOP / SIGCONT a process in turns from a thread, until stopped (then SIGCONT)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stop = threading.Event()
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name="starver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(STOPPED_S)
                os.kill(self.pid, signal.SIGCONT)
                self.cycles += 1
                self._stop.wait(RUNNING_S)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _settled(snap, count: int) -> bool:  # noqa: ANN001
    gen = snap.generation
    return (gen is not None and len(gen.roster) == count
            and set(gen.roster) == set(snap.members)
            and set(gen.roster) <= snap.ready_for(gen.number))


@pytest.mark.slow
def test_a_starved_worker_of_256_members_settles(etcd: str, unique_job: str) -> None:
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.view import JobView

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
    # Starved from its start: members register, the first generation settles, acks come
    # in, leases are refreshed, all late.
    starver = Starver(proc.pid)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = _readline(proc, timeout=SETTLE_TIMEOUT_S)
        assert line == "REGISTERED", line
        time.sleep(STARVED_S)  # the load's duration, not a synchronisation
        starver.stop()
        assert starver.cycles >= 5

        snap = view.wait_for(lambda s: _settled(s, MEMBERS), timeout=SETTLE_TIMEOUT_S)
        assert snap is not None, _describe(view.snapshot(), MEMBERS)
        settled = snap.generation.number
        # And it stays settled: no lease expires and nobody rejoins once the load is gone.
        assert view.wait_for(lambda s: s.generation_number != settled
                             or set(s.members) != set(snap.members), timeout=STABLE_S) is None
        stats = _stats(proc)
        assert stats["errors"] == 0
        assert stats["dropped"] == 0  # no live member was taken for dead
        assert sorted(snap.generation.roster) == stats["members"]
    finally:
        starver.stop()
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


def _stats(proc: subprocess.Popen) -> dict:
    proc.stdin.write("stats\n")
    proc.stdin.flush()
    return json.loads(_readline(proc, timeout=60))


def _describe(snap, count: int) -> str:  # noqa: ANN001
    gen = snap.generation
    if gen is None:
        return f"no generation; {len(snap.members)} members"
    acked = snap.ready_for(gen.number)
    return (f"generation {gen.number}: {len(gen.roster)} listed of {len(snap.members)} "
            f"members (want {count}), {len(acked & set(gen.roster))} acked")


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
