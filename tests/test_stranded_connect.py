"""Freeing a rank that gloo leaves waiting for a member gone mid-rendezvous
(``peer_elastic.torch.gloo.stranded_connect``).

Real gloo throughout: groups are ``ProcessGroupGloo`` objects built on threads of this
process over a ``HashStore``, so a rank's record and its listener are gloo's own. The
multi-process case (a member SIGKILLed while the others connect to it, real etcd) is
``tests/test_rendezvous.py::test_a_member_killed_while_the_others_connect_to_it_costs_no_group_timeouts``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from peer_elastic.torch.gloo.gloo_records import GlooRankRecord
from peer_elastic.torch.gloo.stranded_connect import FormingGuard, release_listening_pairs
from tests.helpers.gloo import ReportingStore, record_bytes


class Doom:
    """``Changes`` and ``doomed()`` for a guard, flipped by the test."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.cond = threading.Condition()

    def doom(self, reason: str) -> None:
        with self.cond:
            self.reason = reason
            self.cond.notify_all()

    def __call__(self) -> str | None:
        return self.reason

    def wait_change(self, version: int, timeout: float,
                    until: Callable[[], bool] | None = None) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.reason is not None or (until is not None and until()),
                               timeout)
        return version + 1

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


def test_release_sends_each_other_ranks_sequence_number_to_the_own_listener() -> None:
    received: list[bytes] = []
    made: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        record = GlooRankRecord("h", socket.AF_INET, "127.0.0.1", port, (11, 12, 13))
        sender = threading.Thread(target=lambda: made.append(
            release_listening_pairs(record, rank=1)))
        sender.start()
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                data = b""
                while chunk := conn.recv(64):
                    data += chunk
                received.append(data)
        sender.join(10)
    assert received == [struct.pack("<Q", 11), struct.pack("<Q", 13)]  # not to itself
    assert made == [2]


class ListenerOfADeadRank:
    """Rank 0 forming a real gloo group of 2 on a thread, whose rank 1 published its record
    and died. With the peer's port above its own (gloo makes the lower address the
    initiator), rank 0 waits as the listener, for five times the 3 s timeout."""

    def __init__(self, prefix: str, guard: FormingGuard) -> None:
        self.inner = dist.PrefixStore(prefix, dist.HashStore())
        # A member that died at once, at a port above any ephemeral one (ours).
        self.inner.set("0/1", record_bytes("127.0.0.1", 65535, [0, 1]))
        self.store = ReportingStore(self.inner, guard.saw_value)
        self.outcome: list[str] = []
        self.thread = threading.Thread(target=self._form, daemon=True)

    def _form(self) -> None:
        try:
            dist.ProcessGroupGloo(self.store, 0, 2, timedelta(seconds=3))
            self.outcome.append("formed")
        except RuntimeError as exc:
            self.outcome.append(f"failed: {exc}")

    def start(self) -> float:
        self.thread.start()
        return time.monotonic()

    def ended_after(self, started: float) -> float:
        """Seconds from ``started`` until the formation ended (bounded); asserts it did."""
        self.thread.join(30)
        assert not self.thread.is_alive() and self.outcome, "still waiting in gloo"
        return time.monotonic() - started


def test_a_released_listener_is_freed_long_before_gloos_connect_timeout() -> None:
    """A :class:`ListenerOfADeadRank`: once the group is doomed, the guard frees it in well
    under gloo's 15 s."""
    doom = Doom()
    guard = FormingGuard(0, 2, doom, doom, lambda host, port: False, grace_s=0.5)
    rank0 = ListenerOfADeadRank("strand", guard)
    with guard:
        t0 = rank0.start()
        deadline = time.monotonic() + 30
        while not rank0.inner.check(["0/0"]) and time.monotonic() < deadline:
            time.sleep(0.01)  # rank 0's record: gloo is connecting now
        doom.doom("test: a member of generation 2 lost its lease")
        took = rank0.ended_after(t0)
    print(f"freed {took:.2f} s after the start: {rank0.outcome[0][:200]}")
    assert guard.fired == "test: a member of generation 2 lost its lease"
    assert took < 7.5, f"{took:.1f} s: gloo's own wait is 15 s"


def test_a_death_found_by_the_stuck_callback_frees_the_listener_at_once() -> None:
    """As above, but nothing in the view dooms the group: the dead member had acknowledged
    the generation. The stuck callback's probe finds it (a refused probe port)."""
    never = Doom()
    guard = FormingGuard(0, 2, never, never, lambda host, port: False, grace_s=0.3,
                         on_stuck=lambda: "test: rank 1's probe port refused")
    rank0 = ListenerOfADeadRank("stuck", guard)
    with guard:
        took = rank0.ended_after(rank0.start())
    assert guard.fired == "test: rank 1's probe port refused"
    assert took < 7.5, f"{took:.1f} s: gloo's own wait is 15 s"


def test_a_formation_stuck_past_the_grace_asks_for_deaths_and_releases_nothing() -> None:
    never = Doom()
    called: list[float] = []
    asked = threading.Event()

    def on_stuck() -> None:  # finds nobody dead
        called.append(time.monotonic())
        asked.set()

    guard = FormingGuard(0, 2, never, never, lambda host, port: False, grace_s=0.3,
                         on_stuck=on_stuck)
    t0 = time.monotonic()
    with guard:
        assert asked.wait(30), "on_stuck never called"
    assert called[0] - t0 >= 0.3  # not before the grace: live members form in milliseconds
    assert guard.fired is None  # nothing doomed the generation: nothing was released


def test_a_guard_past_its_grace_waits_on_changes_instead_of_spinning() -> None:
    never = Doom()
    calls: list[float] = []

    def doomed() -> str | None:
        calls.append(time.monotonic())
        return None

    with FormingGuard(0, 2, doomed, never, lambda host, port: False, grace_s=0.05):
        threading.Event().wait(1.5)  # measuring a rate over a span, not waiting for an effect
    assert len(calls) <= 5, f"{len(calls)} checks in 1.5 s: the guard spins"
