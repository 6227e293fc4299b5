"""Leases kept alive from a thread of their own.

etcd's Python clients have no keep-alive loop: ``refresh()`` is one round trip. A
:class:`LeaseKeeper` runs one daemon thread that refreshes any number of leases, each about
every TTL/3, and tells the owner at once when etcd says a lease is gone (expired or
revoked). While etcd is unreachable it keeps trying: etcd restores leases with a full TTL
when it comes back, so "unreachable" is not "lost". :class:`Session` is one lease with a
keeper, in the manner of etcd's Go ``concurrency.Session``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from peer_elastic.errors import EtcdAuthError, EtcdError, LeaseNotFound
from peer_elastic.etcd.client import EtcdClient

log = logging.getLogger(__name__)

OnLost = Callable[[int, str], None]


@dataclass(order=True)
class _Due:
    at: float
    lease_id: int = field(compare=False)


@dataclass
class _Kept:
    ttl_s: float
    callbacks: list[OnLost]  # one per keep(); the lease is refreshed while any remains
    last_ok: float


class LeaseKeeper:
    """Refreshes registered leases from one daemon thread.

    ``on_lost(lease_id, why)`` runs in the keeper thread as soon as etcd reports the lease
    gone; the lease is then forgotten. Callbacks must be quick and must not block.
    """

    def __init__(self, client: EtcdClient, name: str = "lease-keeper") -> None:
        self._client = client
        self._leases: dict[int, _Kept] = {}
        self._heap: list[_Due] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def keep(self, lease_id: int, ttl_s: float, on_lost: OnLost) -> None:
        """Start refreshing ``lease_id`` (first refresh after TTL/3).

        Keeping a lease that is already kept (members of one process share the run lease)
        only adds ``on_lost``: the lease is refreshed once, until every keeper forgot it.
        """
        with self._lock:
            kept = self._leases.get(lease_id)
            if kept is not None:
                kept.callbacks.append(on_lost)
                return
            self._leases[lease_id] = _Kept(ttl_s, [on_lost], time.monotonic())
            heapq.heappush(self._heap, _Due(time.monotonic() + self._interval(ttl_s), lease_id))
        self._wake.set()

    def forget(self, lease_id: int, on_lost: OnLost | None = None) -> None:
        """Undo one ``keep`` (the one with ``on_lost``; any, if None)."""
        with self._lock:
            kept = self._leases.get(lease_id)
            if kept is None:
                return
            if on_lost is not None and on_lost in kept.callbacks:
                kept.callbacks.remove(on_lost)
            elif kept.callbacks:
                kept.callbacks.pop()
            if not kept.callbacks:
                del self._leases[lease_id]

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    @staticmethod
    def _interval(ttl_s: float) -> float:
        return max(0.1, ttl_s / 3.0)

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                due = self._heap[0] if self._heap else None
            now = time.monotonic()
            if due is None or due.at > now:
                self._wake.wait(timeout=None if due is None else due.at - now)
                self._wake.clear()
                continue
            with self._lock:
                heapq.heappop(self._heap)
                kept = self._leases.get(due.lease_id)
            if kept is None:
                continue
            self._refresh(due.lease_id, kept)

    def _refresh(self, lease_id: int, kept: _Kept) -> None:
        interval = self._interval(kept.ttl_s)
        try:
            # Budget below the interval: a slow attempt must not starve other leases.
            self._client.keepalive(lease_id, budget_s=interval)
            kept.last_ok = time.monotonic()
            next_at = time.monotonic() + interval
        except LeaseNotFound as exc:
            self._lost(lease_id, kept, str(exc))
            return
        except EtcdAuthError as exc:
            log.error("keeping lease %x alive: %s", lease_id, exc)
            next_at = time.monotonic() + interval
        except EtcdError as exc:
            # Unreachable: keep trying, faster. etcd keeps the lease while it is down.
            silent = time.monotonic() - kept.last_ok
            log.warning("lease %x: etcd unreachable for %.1f s: %s", lease_id, silent, exc)
            next_at = time.monotonic() + min(interval, 0.25)
        with self._lock:
            if lease_id in self._leases:
                heapq.heappush(self._heap, _Due(next_at, lease_id))

    def _lost(self, lease_id: int, kept: _Kept, why: str) -> None:
        with self._lock:
            if self._leases.pop(lease_id, None) is None:
                return
        for callback in kept.callbacks:
            try:
                callback(lease_id, why)
            except Exception:
                log.exception("lease-lost callback failed")


class Session:
    """One lease kept alive: the liveness of a member (or of a run)."""

    def __init__(
        self,
        client: EtcdClient,
        ttl_s: float,
        keeper: LeaseKeeper | None = None,
        on_lost: OnLost | None = None,
        lease_id: int | None = None,
    ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._own_keeper = keeper is None
        self.keeper = keeper or LeaseKeeper(client)
        self.lost = threading.Event()
        self.lost_reason = ""
        self._on_lost = on_lost
        self.lease_id = lease_id if lease_id is not None else client.grant(ttl_s)
        self.keeper.keep(self.lease_id, ttl_s, self._handle_lost)

    def _handle_lost(self, lease_id: int, why: str) -> None:
        self.lost_reason = why
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(lease_id, why)

    def close(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke``, delete the lease and every key attached to it."""
        self.keeper.forget(self.lease_id, self._handle_lost)
        if revoke and not self.lost.is_set():
            try:
                self.client.revoke(self.lease_id, budget_s=self.ttl_s)
            except EtcdError as exc:
                log.warning("revoking lease %x: %s (it will expire)", self.lease_id, exc)
        if self._own_keeper:
            self.keeper.stop()
