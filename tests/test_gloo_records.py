"""gloo's rank records and the listeners they name (``peer_elastic.torch.gloo_records``),
and the connections found by those listeners (``GroupConnections.touching``).

Real gloo: groups are ``ProcessGroupGloo`` objects built on threads of this process over a
``HashStore`` that reports what passes through it, as ``EtcdStore(on_value=...)`` does. The
multi-process case (a subgroup made in the training function, a peer SIGSTOPped, real
etcd) is ``tests/test_abort.py::test_a_subgroup_made_in_the_training_function_is_abandoned_with_its_group``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from peer_elastic.torch.abort import GroupConnections
from peer_elastic.torch.gloo_records import GlooListeners, parse_gloo_rank


class ReportingStore(dist.Store):
    """A torch store that reports each value written or read."""

    def __init__(self, inner: dist.Store, saw: Callable[[str, bytes], None]) -> None:
        super().__init__()
        self.inner, self.saw = inner, saw

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data)
        self.saw(key, data)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self.saw(key, value)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)


def two_ranks(store: dist.Store, timeout_s: float = 30.0) -> list[dist.ProcessGroup]:
    """Both ranks of a real gloo group, made on two threads of this process."""
    groups: dict[int, dist.ProcessGroup] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(
        r, dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=timeout_s)))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(groups) == 2
    return [groups[0], groups[1]]


@pytest.fixture
def unrelated_connection():
    """A loopback connection of this process that no gloo group made."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted


def inode(sock: socket.socket) -> int:
    import os
    return os.fstat(sock.fileno()).st_ino


def test_the_listeners_of_groups_made_later_find_their_connections_and_no_other(
        unrelated_connection) -> None:
    listeners = GlooListeners()
    base = dist.HashStore()
    first = two_ranks(ReportingStore(dist.PrefixStore("default_pg", base), listeners.saw_value))
    assert len(listeners.addresses()) == 2  # one listener per rank
    later = two_ranks(ReportingStore(dist.PrefixStore("sub", base), listeners.saw_value))
    assert len(listeners.addresses()) == 4
    found = GroupConnections.touching(listeners.addresses())
    # Each group's one pair has both its ends in this process: 2 sockets per group.
    assert len(found.inodes) == 4, found.inodes
    assert not {inode(s) for s in unrelated_connection} & found.inodes
    assert GroupConnections.touching(frozenset()).inodes == frozenset()
    del first, later


def test_cutting_them_ends_a_collective_blocked_in_a_group_made_later() -> None:
    # Rank 0 of the later group waits in an all-reduce rank 1 never joins (gloo's own wait:
    # 30 s); cutting the connections the listeners find ends it at once.
    listeners = GlooListeners()
    base = dist.HashStore()
    first = two_ranks(ReportingStore(dist.PrefixStore("default_pg", base),
                                     listeners.saw_value))
    rank0, _rank1 = two_ranks(ReportingStore(dist.PrefixStore("sub", base),
                                             listeners.saw_value))
    work = rank0.allreduce([torch.ones(1)])
    time.sleep(0.2)  # rank 0 is inside the collective, waiting on rank 1
    t0 = time.monotonic()
    found = GroupConnections.touching(listeners.addresses())
    assert len(found.inodes) == 4
    # Both ends are here: one end's shutdown may reset the other before it is shut down.
    assert found.cut() >= 2
    with pytest.raises(RuntimeError, match="(?i)closed|reset"):
        work.wait()
    assert time.monotonic() - t0 < 5.0
    del first


def test_records_of_any_size_parse_and_others_are_not_listeners() -> None:
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def keep(key: str, value: bytes) -> None:
        with lock:
            seen.append((key, value))

    two_ranks(ReportingStore(dist.PrefixStore("any", dist.HashStore()), keep))
    records = [r for _, v in seen if (r := parse_gloo_rank(v)) is not None]
    assert records and all(r.pair_ids == (0, 1) and r.port > 0 for r in records)
    listeners = GlooListeners()
    for key, value in [("x", b""), ("y", b"\x07" * 8), ("z", b"1")]:
        listeners.saw_value(key, value)  # counters, flags, torch's own keys
    assert listeners.addresses() == frozenset()
