"""AckBatcher: concurrent acks of one process go out in one transaction; a lease that is
gone fails only its own ack. Fake client (the real path runs in every coordination test)."""

from __future__ import annotations

import threading

from peer_elastic.errors import EtcdUnavailable, LeaseNotFound
from peer_elastic.etcd.acks import AckBatcher

WAIT_S = 20.0


class FakeKV:
    """put/txn of an etcd where leases in ``gone`` do not exist; ``gate`` holds the first
    write until released, so the others queue behind it."""

    def __init__(self, gone: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.gone = gone
        self.data: dict[str, bytes] = {}
        self.writes: list[int] = []  # ops per write
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def _check(self, lease: int) -> None:
        if lease in self.gone:
            raise LeaseNotFound("etcdserver: requested lease not found")

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if self.fail is not None:
            raise self.fail
        self._check(lease or 0)
        self.writes.append(1)
        self.data[key] = value
        return 1

    def txn(self, compare: list, success: list, failure: list | None = None) -> tuple:
        if self.fail is not None:
            raise self.fail
        for op in success:
            self._check(op.lease)
        self.writes.append(len(success))
        for op in success:
            self.data[op.key] = op.value
        return True, []


def _ack_all(batcher: AckBatcher, fake: FakeKV, n: int) -> dict[int, BaseException | None]:
    results: dict[int, BaseException | None] = {}

    def ack(i: int) -> None:
        try:
            batcher.put(f"k{i}", b"v", 100 + i)
            results[i] = None
        except Exception as exc:
            results[i] = exc

    first = threading.Thread(target=ack, args=(0,))
    first.start()
    assert fake.entered.wait(WAIT_S)  # the first ack is on its way; the rest queue up
    rest = [threading.Thread(target=ack, args=(i,)) for i in range(1, n)]
    for t in rest:
        t.start()
    while batcher.queued < n - 1:
        threading.Event().wait(0.001)
    fake.gate.set()
    for t in [first, *rest]:
        t.join(WAIT_S)
    return results


def test_acks_queued_behind_one_write_go_out_in_one_transaction() -> None:
    fake = FakeKV()
    batcher = AckBatcher(fake)  # type: ignore[arg-type]
    results = _ack_all(batcher, fake, 50)
    assert all(r is None for r in results.values())
    assert fake.writes == [1, 49]
    assert set(fake.data) == {f"k{i}" for i in range(50)}


def test_a_gone_lease_fails_only_its_own_ack() -> None:
    fake = FakeKV(gone={100 + 7})
    batcher = AckBatcher(fake)  # type: ignore[arg-type]
    results = _ack_all(batcher, fake, 20)
    assert isinstance(results[7], LeaseNotFound)
    assert all(r is None for i, r in results.items() if i != 7)
    assert "k7" not in fake.data and len(fake.data) == 19


def test_an_unreachable_etcd_fails_every_queued_ack_and_the_next_ack_writes_again() -> None:
    fake = FakeKV()
    fake.fail = EtcdUnavailable("no etcd endpoint answered")
    batcher = AckBatcher(fake)  # type: ignore[arg-type]
    results = _ack_all(batcher, fake, 5)
    assert all(isinstance(r, EtcdUnavailable) for r in results.values())
    fake.fail = None
    batcher.put("again", b"v", 1)
    assert "again" in fake.data


def test_batches_larger_than_etcds_txn_limit_are_split() -> None:
    from peer_elastic.etcd.acks import MAX_BATCH

    fake = FakeKV()
    batcher = AckBatcher(fake)  # type: ignore[arg-type]
    results = _ack_all(batcher, fake, MAX_BATCH + 31)
    assert all(r is None for r in results.values())
    assert fake.writes == [1, MAX_BATCH, 30]
    assert len(fake.data) == MAX_BATCH + 31
