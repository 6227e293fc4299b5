"""Leases kept alive from a thread of their own.

etcd's Python clients have no keep-alive loop: ``refresh()`` is one round trip. A
:class:`LeaseKeeper` runs a daemon thread per :class:`Lane` that refreshes any number of
leases, each about every TTL/3 (those due together over one stream), and tells the owner at
once when etcd says a lease is gone (expired or revoked). While etcd is unreachable it keeps
trying: etcd restores leases with a full TTL when it comes back, so "unreachable" is not
"lost". :class:`Session` is one lease with a
keeper, in the manner of etcd's Go ``concurrency.Session``.
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from peer_elastic.errors import EtcdAuthError, EtcdError, LeaseNotFound
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.process import threads

log = logging.getLogger(__name__)

OnLost = Callable[[int, str], None]


class Lane(enum.Enum):
    """Which refresh thread of a :class:`LeaseKeeper` keeps a lease alive.

    A run lease must outlive every member: it gets a thread of its own, so it is never
    refreshed late because hundreds of member leases of the same process were due first
    (an expired run lease ends the run for everyone; an expired member lease only makes that
    member rejoin).
    """

    MEMBER = "member"
    RUN = "run"


#: Leases due within this much of the first due one are refreshed in the same round (one
#: stream): refreshing a little early is harmless, one stream per lease is not.
BATCH_AHEAD_S = 0.25
#: Most leases refreshed over one stream.
BATCH_MAX = 500


@dataclass(order=True)
class _Due:
    at: float
    lease_id: int = field(compare=False)


@dataclass
class _Kept:
    ttl_s: float
    callbacks: list[OnLost]  # one per keep(); the lease is refreshed while any remains
    last_ok: float

    @property
    def interval(self) -> float:
        return max(0.1, self.ttl_s / 3.0)


class _RefreshThread:
    """One daemon thread refreshing a set of leases, each about every TTL/3, in batches."""

    def __init__(self, client: EtcdClient, name: str) -> None:
        self._client = client
        self.leases: dict[int, _Kept] = {}
        self.heap: list[_Due] = []
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self.thread = threads.start(self._run, name)

    def keep(self, lease_id: int, ttl_s: float, on_lost: OnLost, refresh_now: bool,
             granted_since: float | None) -> None:
        with self.lock:
            kept = self.leases.get(lease_id)
            if kept is not None:
                kept.callbacks.append(on_lost)
                return
            now = time.monotonic()
            kept = _Kept(ttl_s, [on_lost], now)
            self.leases[lease_id] = kept
            if refresh_now:
                first = now
            else:
                first = (now if granted_since is None else min(now, granted_since)) + kept.interval
            heapq.heappush(self.heap, _Due(first, lease_id))
        self._wake.set()

    def forget(self, lease_id: int, on_lost: OnLost | None) -> bool:
        """Undo one keep; False when this thread does not keep ``lease_id``."""
        with self.lock:
            kept = self.leases.get(lease_id)
            if kept is None:
                return False
            if on_lost is not None and on_lost in kept.callbacks:
                kept.callbacks.remove(on_lost)
            elif kept.callbacks:
                kept.callbacks.pop()
            if not kept.callbacks:
                del self.leases[lease_id]
            return True

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            now = time.monotonic()
            with self.lock:
                first = self.heap[0].at if self.heap else None
                due: dict[int, _Kept] = {}
                if first is not None and first <= now:
                    while self.heap and self.heap[0].at <= now + BATCH_AHEAD_S \
                            and len(due) < BATCH_MAX:
                        lease_id = heapq.heappop(self.heap).lease_id
                        kept = self.leases.get(lease_id)
                        if kept is not None:
                            due[lease_id] = kept
            if first is None or first > now:
                self._wake.wait(timeout=None if first is None else first - now)
                self._wake.clear()
                continue
            if due:
                self._refresh(due)

    def _refresh(self, due: dict[int, _Kept]) -> None:
        # Budget below the shortest interval: a slow round must not starve the next one.
        budget = min(k.interval for k in due.values())
        try:
            if len(due) == 1:
                [(lease_id, _)] = due.items()
                ttls = {lease_id: self._client.keepalive(lease_id, budget_s=budget)}
            else:
                ttls = self._client.keepalive_many(list(due), budget_s=budget)
        except LeaseNotFound as exc:
            if len(due) == 1:
                [(lease_id, kept)] = due.items()
                self._lost(lease_id, kept, str(exc))
                return
            ttls = {lease_id: 0 for lease_id in due}  # find out which (_confirm)
        except EtcdAuthError as exc:
            log.error("keeping %d lease(s) alive: %s", len(due), exc)
            self._schedule({i: time.monotonic() + k.interval for i, k in due.items()})
            return
        except EtcdError as exc:
            # Unreachable: keep trying, faster. etcd keeps the leases while it is down.
            silent = time.monotonic() - min(k.last_ok for k in due.values())
            log.warning("%d lease(s): etcd unreachable for %.1f s: %s", len(due), silent, exc)
            self._schedule({i: time.monotonic() + min(k.interval, 0.25) for i, k in due.items()})
            return
        next_at: dict[int, float] = {}
        unanswered = [i for i in due if i not in ttls]
        if unanswered:
            # The stream was cut short (EtcdClient.keepalive_many): the answered leases are
            # refreshed, the rest are tried again soon, as while etcd is unreachable.
            log.info("%d of %d lease(s) not answered in time; trying them again",
                     len(unanswered), len(due))
            soon = time.monotonic()
            for lease_id in unanswered:
                next_at[lease_id] = soon + min(due[lease_id].interval, 0.25)
        # One keep-alive answers a lost lease with an exception (EtcdClient.keepalive has
        # confirmed it); a round answers TTL 0, confirmed here for all such leases at once.
        confirmed = self._confirm([i for i in due if ttls.get(i, 1) <= 0], budget) \
            if len(due) > 1 else {}
        for lease_id, kept in due.items():
            if lease_id not in ttls:
                continue
            soon = time.monotonic() + min(kept.interval, 0.25)
            if lease_id not in confirmed:
                kept.last_ok = time.monotonic()
                next_at[lease_id] = kept.last_ok + kept.interval
            elif confirmed[lease_id] is None:  # no answer yet: ask again soon
                next_at[lease_id] = soon
            elif confirmed[lease_id] <= 0:
                self._lost(lease_id, kept, f"lease {lease_id:x} expired or was revoked")
            else:
                # etcd knows it after all, but the round did not refresh it: again soon.
                kept.last_ok = time.monotonic()
                next_at[lease_id] = soon
        self._schedule(next_at)

    def _confirm(self, lease_ids: list[int], budget: float) -> dict[int, int | None]:
        """Ask etcd again about leases a round answered with TTL 0, before believing it
        (see EtcdClient.keepalive): lease id -> seconds left, or None when not known yet.

        All of them in one call: after an overload expired every member's lease, confirming
        them one by one took two round trips each on this lane's only thread, and the
        leases the members rejoined with waited behind that, past their own TTL.
        """
        if not lease_ids:
            return {}
        try:
            answered = self._client.lease_ttls(lease_ids, budget_s=budget)
        except EtcdError as exc:
            log.warning("confirming %d lost lease(s): %s; asking again", len(lease_ids), exc)
            answered = {}
        return {lease_id: answered.get(lease_id) for lease_id in lease_ids}

    def _schedule(self, next_at: dict[int, float]) -> None:
        with self.lock:
            for lease_id, at in next_at.items():
                if lease_id in self.leases:
                    heapq.heappush(self.heap, _Due(at, lease_id))

    def _lost(self, lease_id: int, kept: _Kept, why: str) -> None:
        with self.lock:
            if self.leases.pop(lease_id, None) is None:
                return
        for callback in kept.callbacks:
            try:
                callback(lease_id, why)
            except Exception:
                log.exception("lease-lost callback failed")


class LeaseKeeper:
    """Refreshes registered leases from daemon threads: one per :class:`Lane` in use.

    Leases of one lane that fall due together are refreshed over one stream
    (:meth:`EtcdClient.keepalive_many`), so a process with hundreds of members pays one round
    trip per refresh round, not one per member.

    ``on_lost(lease_id, why)`` runs in a keeper thread as soon as etcd reports the lease
    gone; the lease is then forgotten. Callbacks must be quick and must not block.
    """

    def __init__(self, client: EtcdClient, name: str = "lease-keeper") -> None:
        self._client = client
        self._name = name
        self._lock = threading.Lock()
        self._threads: dict[Lane, _RefreshThread] = {Lane.MEMBER: _RefreshThread(client, name)}
        self._stopped = False

    def keep(self, lease_id: int, ttl_s: float, on_lost: OnLost,
             lane: Lane = Lane.MEMBER, refresh_now: bool = False,
             granted_since: float | None = None) -> None:
        """Start refreshing ``lease_id`` (first refresh after TTL/3; at once with
        ``refresh_now``: a lease granted by someone else, such as a run lease adopted from a
        peer that died, may have less than TTL/3 left) in ``lane``.

        ``granted_since`` (``time.monotonic()`` just before the grant was asked for): the
        TTL runs from when etcd granted it, which may be long before its answer was read on
        a starved process, so the first refresh counts from then.

        Keeping a lease that is already kept (members of one process share the run lease)
        only adds ``on_lost``: the lease is refreshed once, until every keeper forgot it.
        """
        with self._lock:
            refresher = self._threads.get(lane)
            if refresher is None:
                refresher = _RefreshThread(self._client, f"{self._name}:{lane.value}")
                self._threads[lane] = refresher
        refresher.keep(lease_id, ttl_s, on_lost, refresh_now, granted_since)

    def _refreshers(self) -> list[_RefreshThread]:
        """The lanes' threads now (a copy: ``keep`` may add a lane meanwhile)."""
        with self._lock:
            return list(self._threads.values())

    def forget(self, lease_id: int, on_lost: OnLost | None = None) -> None:
        """Undo one ``keep`` (the one with ``on_lost``; any, if None)."""
        for refresher in self._refreshers():
            if refresher.forget(lease_id, on_lost):
                return

    def keeps(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is kept alive here (in any lane)."""
        for refresher in self._refreshers():
            with refresher.lock:
                if lease_id in refresher.leases:
                    return True
        return False

    def scheduled(self, lease_id: int) -> int:
        """How many refreshes of ``lease_id`` are queued: 1 while it is kept, else 0."""
        count = 0
        for refresher in self._refreshers():
            with refresher.lock:
                if lease_id in refresher.leases:
                    count += sum(1 for d in refresher.heap if d.lease_id == lease_id)
        return count

    def stop(self) -> None:
        for refresher in self._refreshers():
            refresher.stop()


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
        asked = time.monotonic()
        self.lease_id = lease_id if lease_id is not None else client.grant(ttl_s)
        self.keeper.keep(self.lease_id, ttl_s, self._handle_lost,
                         granted_since=asked if lease_id is None else None)

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
