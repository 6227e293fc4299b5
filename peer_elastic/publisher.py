"""What a peer says in etcd about its training, written off the training thread.

:class:`Publisher` takes progress (``Peer.record_progress``), the state's commit count
(:mod:`peer_elastic.state.lost_state`'s mark) and events (a group formed, state lost) from
the training thread and writes them from a thread of its own, so the training thread never
waits on etcd.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from peer_elastic.errors import PeerElasticError
from peer_elastic.process import threads

__all__ = ["ProgressRecorder", "Publisher"]

log = logging.getLogger(__name__)


class ProgressRecorder(Protocol):
    """What :class:`Publisher` writes through (the coordinator's writes into the run)."""

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None,
                     timings: Mapping[str, float] | None = None) -> None: ...

    def record_state(self, commits: int, generation: int) -> None: ...

    def record_progress(self, **fields: int) -> None: ...


class Publisher:
    """Writes progress (the newest, at most once a second), the state's commit count
    (peer_elastic.state.lost_state) and events from a thread, so the training thread never waits
    on etcd."""

    def __init__(self, coordinator: ProgressRecorder, period_s: float = 1.0) -> None:
        self._coord = coordinator
        self._period = period_s
        self._latest: dict[str, int] | None = None
        self._state: tuple[int, int] | None = None  # (commits, generation) to say
        self._events: list[tuple[str, str, int, dict[str, float]]] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def offer(self, **fields: int) -> None:
        with self._cv:
            self._latest = fields
            self._start()

    def offer_state(self, commits: int, generation: int) -> None:
        with self._cv:
            self._state = (commits, generation)
            self._start()

    def offer_event(self, kind: str, detail: str, generation: int,
                    timings: dict[str, float]) -> None:
        with self._cv:
            self._events.append((kind, detail, generation, timings))
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threads.start(self._publish_loop, "publisher")
        self._cv.notify()

    def _publish_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._latest is not None or self._events
                                  or self._state is not None or self._stopped)
                if self._stopped:
                    return
                fields, self._latest = self._latest, None
                events, self._events = self._events, []
                committed, self._state = self._state, None
            for kind, detail, generation, timings in events:
                self._coord.record_event(kind, detail, generation=generation, timings=timings)
            if committed is not None:
                self._coord.record_state(*committed)
            if fields is not None:
                try:
                    self._coord.record_progress(**fields)
                except PeerElasticError as exc:
                    log.debug("progress not recorded: %s", exc)
                time.sleep(self._period)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
