"""A prefix watch that never silently misses an event.

The client's watches die on any stream error (and when the client closes the stream itself
after a failover) and are never re-created. :class:`PrefixWatch` reads the prefix at
revision R, watches from R+1, remembers the last revision it delivered, and after any
error re-creates the watch from there, with backoff. When etcd has compacted that revision
away it re-reads the whole prefix and hands the consumer a fresh snapshot, so the consumer's
picture is always the one etcd has at some revision, never one with holes.

Consumers get callbacks from a single thread, in revision order:
``on_snapshot(kvs, revision)`` (initially and after a compaction) and
``on_events(events, revision)``.

When the consumer falls behind (hundreds of members in one process, a loaded machine), the
watch responses that queued up meanwhile are handed over in one ``on_events`` call: the
consumer pays its per-call cost (a new picture, waking its waiters) once per backlog instead
of once per response, so its cost stops growing with the rate of events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from peer_elastic.errors import ClientClosed, EtcdError, RevisionCompacted
from peer_elastic.etcd.client import EtcdClient, KeyValue, WatchEvent
from peer_elastic.process import threads

log = logging.getLogger(__name__)

OnSnapshot = Callable[[list[KeyValue], int], None]
OnEvents = Callable[[list[WatchEvent], int], None]

#: At most this many queued watch responses are merged into one delivery (a bound on the
#: delay a merged batch adds for the first of its events).
MAX_COALESCED = 256

_Item = tuple[int, Any, int]  # (epoch, events | exception | None, header revision)


class PrefixWatch:
    """Supervised watch of one prefix; see the module docstring."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        on_snapshot: OnSnapshot,
        on_events: OnEvents,
        max_backoff_s: float = 1.0,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self._on_snapshot = on_snapshot
        self._on_events = on_events
        self._on_connected = on_connected
        self._max_backoff_s = max_backoff_s
        self._items: queue.Queue[_Item] = queue.Queue()
        self._held: _Item | None = None  # taken from the queue while coalescing, not events
        self._epoch = 0  # bumped per re-created watch; items of dead watches are dropped
        self._watch_id: int | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.revision = 0  # last revision delivered to the consumer
        self.connected_at = 0.0  # time.monotonic() when the watch last (re)started streaming
        self.restarts = 0
        self.resyncs = 0

    def start(self) -> int:
        """Read the prefix, deliver the snapshot, start watching; returns the revision."""
        self._resync()
        self._thread = threads.start(self._run, f"watch:{self.prefix}")
        return self.revision

    def stop(self) -> None:
        self._stopped.set()
        self._items.put((-1, None, 0))
        if self._watch_id is not None:
            self._client.cancel_watch(self._watch_id)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # -- internals ---------------------------------------------------------------------------------

    def _resync(self) -> None:
        kvs, rev = self._client.get_prefix(self.prefix)
        self.revision = rev
        self.connected_at = time.monotonic()
        self._on_snapshot(kvs, rev)

    def _create_watch(self) -> None:
        self._epoch += 1
        epoch = self._epoch

        def on_events(events: list[WatchEvent], rev: int) -> None:
            self._items.put((epoch, events, rev))

        def on_error(exc: Exception) -> None:
            self._items.put((epoch, exc, 0))

        self._watch_id = self._client.watch_prefix(
            self.prefix, on_events, on_error, start_revision=self.revision + 1
        )
        self.connected_at = time.monotonic()

    def _run(self) -> None:
        try:
            self._follow()
        except ClientClosed:
            log.debug("watch %s ends: its client was closed", self.prefix)

    def _follow(self) -> None:
        backoff = 0.05
        need_watch = True
        while not self._stopped.is_set():
            if need_watch:
                try:
                    self._create_watch()
                    need_watch = False
                    if self._on_connected is not None:
                        self._on_connected()
                except RevisionCompacted:
                    self._recover_compacted()
                    continue
                except ClientClosed:
                    raise  # for good: _run ends the watch
                except EtcdError as exc:
                    log.warning("watch %s: cannot re-create yet: %s", self.prefix, exc)
                    self._stopped.wait(backoff)
                    backoff = min(self._max_backoff_s, backoff * 2)
                    continue
            epoch, item, rev = self._next_item()
            if self._stopped.is_set():
                return
            if epoch != self._epoch:
                continue  # leftovers of a watch that already failed
            if isinstance(item, RevisionCompacted):
                self._recover_compacted()
                need_watch = True
            elif isinstance(item, Exception):
                self.restarts += 1
                log.info("watch %s: %s; resuming from revision %d", self.prefix, item,
                         self.revision + 1)
                self._epoch += 1  # ignore anything the dead watch still sends
                need_watch = True
            else:
                backoff = 0.05
                events, rev = self._coalesce(item, rev)
                self._deliver(events, rev)

    def _next_item(self) -> _Item:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        return self._items.get()

    def _coalesce(self, events: list[WatchEvent], rev: int) -> tuple[list[WatchEvent], int]:
        """Append the events of every response of the current watch already queued behind
        this one (up to :data:`MAX_COALESCED`). Anything else (an error, the stop marker)
        ends the batch and is held for the next round, so order is kept."""
        merged: list[WatchEvent] | None = None
        for _ in range(MAX_COALESCED - 1):
            try:
                nxt = self._items.get_nowait()
            except queue.Empty:
                break
            epoch, item, nrev = nxt
            if epoch == self._epoch and isinstance(item, list):
                if merged is None:
                    merged = list(events)
                merged.extend(item)
                rev = max(rev, nrev)
                continue
            if epoch == self._epoch or epoch < 0:
                self._held = nxt
                break
            # else: leftovers of a watch that already failed
        return (events if merged is None else merged), rev

    def _deliver(self, events: list[WatchEvent], header_rev: int) -> None:
        fresh = [e for e in events if e.kv.mod_revision > self.revision]
        if fresh:
            self.revision = max(e.kv.mod_revision for e in fresh)
        elif not events:
            # A progress notification: everything up to header_rev has been sent.
            self.revision = max(self.revision, header_rev)
        if fresh:
            self._on_events(fresh, self.revision)

    def _recover_compacted(self) -> None:
        self.resyncs += 1
        log.info("watch %s: revision %d was compacted; re-reading the prefix", self.prefix,
                 self.revision + 1)
        while not self._stopped.is_set():
            try:
                self._resync()
                return
            except EtcdError as exc:
                log.warning("watch %s: re-read failed: %s", self.prefix, exc)
                self._stopped.wait(0.5)
