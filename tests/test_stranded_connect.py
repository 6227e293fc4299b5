"""Freeing a rank that gloo leaves waiting for a member gone mid-rendezvous
(``peer_elastic.torch.stranded_connect``).

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

import pytest
import torch.distributed as dist

from peer_elastic.torch.gloo_records import GlooRankRecord, parse_gloo_rank
from peer_elastic.torch.stranded_connect import FormingGuard, release_listening_pairs


class SpyStore(dist.Store):
    """A torch store that tells ``on_set`` of every write (as ``EtcdStore(on_value=...)``
    does, and of every read)."""

    def __init__(self, inner: dist.Store, on_set: Callable[[str, bytes], None]) -> None:
        super().__init__()
        self.inner = inner
        self.on_set = on_set

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.on_set(key, data)
        self.inner.set(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)


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


def record_bytes(host: str, port: int, pair_ids: list[int], name: bytes = b"h1") -> bytes:
    """A gloo tcp rank record (``Rank::bytes``) for an IPv4 listener."""
    storage = bytearray(128)
    storage[0:2] = socket.AF_INET.to_bytes(2, "little")
    storage[2:4] = port.to_bytes(2, "big")
    storage[4:8] = socket.inet_aton(host)
    address = bytes(storage) + struct.pack("<q", -1)
    return (struct.pack("<Q", len(name)) + name + struct.pack("<Q", len(address)) + address
            + struct.pack(f"<{len(pair_ids)}q", *pair_ids))


def test_gloos_own_records_parse() -> None:
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def keep(key: str, value: bytes) -> None:
        with lock:
            seen.append((key, value))

    store = SpyStore(dist.PrefixStore("parse", dist.HashStore()), keep)
    groups: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(
        r, dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(groups) == 2
    records = {key: parse_gloo_rank(value, 2) for key, value in seen}
    assert set(records) == {"0/0", "0/1"}, records
    for record in records.values():
        assert record is not None and record.port > 0 and record.pair_ids == (0, 1)
        assert record.family == socket.AF_INET and record.host == "127.0.0.1"
    assert parse_gloo_rank(seen[0][1], 3) is None  # one rank more: the lengths disagree


@pytest.mark.parametrize("value", [
    b"", b"\x01", record_bytes("10.0.0.1", 80, [0, 1])[:-1],  # truncated
    record_bytes("10.0.0.1", 80, [0, 1]) + b"\0" * 8,  # a pair id too many
    record_bytes("10.0.0.1", 0, [0, 1]),  # no port
    record_bytes("10.0.0.1", 80, [0, -5]),  # a negative sequence number
    struct.pack("<Q", 2**40) + b"x",  # a hostname longer than the value
])
def test_values_that_are_not_a_rank_record_are_ignored(value: bytes) -> None:
    assert parse_gloo_rank(value, 2) is None


def test_a_valid_record_round_trips() -> None:
    record = parse_gloo_rank(record_bytes("10.1.2.3", 4242, [7, 0, 9], b"host-a"), 3)
    assert record == GlooRankRecord("host-a", socket.AF_INET, "10.1.2.3", 4242, (7, 0, 9))


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
        self.store = SpyStore(self.inner, guard.saw_value)
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
