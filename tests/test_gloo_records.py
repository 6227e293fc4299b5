"""gloo's rank records and the listeners they name (``peer_elastic.torch.gloo.gloo_records``),
and the connections found by those listeners (``GroupConnections.touching``).

Real gloo: groups are ``ProcessGroupGloo`` objects built on threads of this process over a
``HashStore`` that reports what passes through it, as ``EtcdStore(on_value=...)`` does. The
multi-process case (a subgroup made in the training function, a peer SIGSTOPped, real
etcd) is ``tests/test_abort.py::test_a_subgroup_made_in_the_training_function_is_abandoned_with_its_group``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from peer_elastic.torch.gloo.abort import GroupConnections
from peer_elastic.torch.gloo.gloo_records import GlooListeners, GlooRankRecord, parse_gloo_rank
from tests.helpers.gloo import ReportingStore, record_bytes


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


def test_gloos_own_records_parse() -> None:
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def keep(key: str, value: bytes) -> None:
        with lock:
            seen.append((key, value))

    two_ranks(ReportingStore(dist.PrefixStore("parse", dist.HashStore()), keep))
    records = {key: parse_gloo_rank(value, 2) for key, value in seen}
    assert set(records) == {"0/0", "0/1"}, records
    for record in records.values():
        assert record is not None and record.port > 0 and record.pair_ids == (0, 1)
        assert record.family == socket.AF_INET and record.host == "127.0.0.1"
    assert parse_gloo_rank(seen[0][1], 3) is None  # one rank more: the lengths disagree
    assert parse_gloo_rank(seen[0][1]) == records[seen[0][0]]  # of any size: the same


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


def test_only_rank_records_name_listeners() -> None:
    listeners = GlooListeners()
    for key, value in [("x", b""), ("y", b"\x07" * 8), ("z", b"1")]:
        listeners.saw_value(key, value)  # counters, flags, torch's own keys
    listeners.saw_value("sub/1", record_bytes("10.0.0.7", 4000, [3, 0, 5]))
    assert listeners.addresses() == frozenset({("10.0.0.7", 4000)})
