"""Acks of the members of one process, written together.

When a generation appears, every member of a process acks it at the same moment: hundreds
of members simulated in one process, or several peers of a multi-GPU host sharing a client.
One ``put`` each costs a round trip each, and one revision (so one watch response, one new
picture, one wake-up of every waiting thread) each in every process watching the job.
:class:`AckBatcher` is a group commit instead: the first member to ack writes every ack
queued meanwhile in one transaction, the others wait for it. One member acking alone pays
nothing extra.

A transaction is all or nothing: when etcd refuses a batch because one member's lease is
gone, the batch is written again one ack at a time, so only that member sees the error.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from peer_elastic.errors import EtcdError, LeaseNotFound
from peer_elastic.etcd.client import EtcdClient, Txn

#: Most puts in one transaction (etcd's default --max-txn-ops is 128).
MAX_BATCH = 100


@dataclass
class _Pending:
    key: str
    value: bytes
    lease: int
    wake: threading.Event = field(default_factory=threading.Event)  # written, or our turn
    lead: bool = False  # this submitter writes the queue now
    finished: bool = False
    error: EtcdError | None = None


class AckBatcher:
    """Group commit of puts through one client; see the module docstring.

    The submitter that finds nobody writing becomes the flusher: it writes queued batches
    until its own ack is in, then hands the rest to the oldest waiter, so no member's
    thread works for the others longer than for its own batch and the one before it.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._flushing = False
        self.batches = 0  # transactions written (for tests and benchmarks)

    @property
    def queued(self) -> int:
        """Acks waiting for a batch now (for tests and benchmarks)."""
        with self._lock:
            return len(self._queue)

    def put(self, key: str, value: bytes, lease: int) -> None:
        """Write ``key`` under ``lease``, together with whatever other acks are queued.

        Returns once etcd holds it; raises what a plain ``put`` would."""
        mine = _Pending(key, value, lease)
        with self._lock:
            self._queue.append(mine)
            if not self._flushing:
                self._flushing = mine.lead = True
        if not mine.lead:
            mine.wake.wait()  # written by another, or handed the lead
        if not mine.finished:
            self._flush_until_written(mine)
        if mine.error is not None:
            raise mine.error

    def _flush_until_written(self, mine: _Pending) -> None:
        while not mine.finished:  # ours is queued, so some batch below holds it
            with self._lock:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            self._write(batch)
        with self._lock:
            if self._queue:
                successor = self._queue[0]
                successor.lead = True
                successor.wake.set()
            else:
                self._flushing = False

    def _write(self, batch: list[_Pending]) -> None:
        try:
            if len(batch) == 1:
                self._client.put(batch[0].key, batch[0].value, batch[0].lease)
            else:
                self._client.txn([], [Txn.put(p.key, p.value, p.lease) for p in batch])
                self.batches += 1
        except LeaseNotFound as exc:
            if len(batch) == 1:
                self._finish(batch, exc)
            else:
                for p in batch:  # one member's lease is gone: find out whose, alone
                    self._write([p])
            return
        except EtcdError as exc:
            self._finish(batch, exc)
            return
        except Exception as exc:  # never leave the waiters of a batch hanging
            self._finish(batch, EtcdError(f"writing {len(batch)} ack(s): {exc!r}"))
            return
        self._finish(batch, None)

    @staticmethod
    def _finish(batch: list[_Pending], error: EtcdError | None) -> None:
        for p in batch:
            p.error = error
            p.finished = True
            p.wake.set()


_batchers: weakref.WeakKeyDictionary[EtcdClient, AckBatcher] = weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(client: EtcdClient) -> AckBatcher:
    """The batcher of ``client``: members sharing a client share it (and their batches)."""
    with _batchers_lock:
        batcher = _batchers.get(client)
        if batcher is None:
            batcher = _batchers[client] = AckBatcher(client)
        return batcher
