"""The straggler watch's writes to etcd, from a thread of their own.

The training thread decides (:mod:`peer_elastic.straggler.watch`) and hands the writes
here, so it never waits on etcd (a straggler least of all: every peer waits on it):

* the pace record (``<run>/pace``, rank 0 only): every roster member's pace and score, for
  ``status`` and the dashboard. The newest one offered is written, at most every
  :data:`PACE_EVERY_S`;
* a ``straggler`` event: the member, its host, its score, and what it did (once per
  episode);
* an eviction: the member's drain record and a ``drain requested`` event, in one
  transaction that only writes when no drain record of the member exists (an operator's
  ``drain``, an earlier eviction). The drain takes the member out of the roster exactly as
  ``peer-elastic drain`` does: every rank raises at the same check, nothing is redone.
  When the transaction does not write (a drain was there already, etcd did not answer),
  ``on_not_evicted`` is called: the member is not leaving as a straggler.

Writes go through the coordinator's current registration (its run writer); without one
(a lost lease) they are dropped, logged. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from peer_elastic.errors import EtcdError, RecordError
from peer_elastic.etcd.client import Txn
from peer_elastic.etcd.writer import RunWriter, holds
from peer_elastic.process import threads
from peer_elastic.records import DrainRecord, EventRecord, PaceRecord, encode

log = logging.getLogger(__name__)

__all__ = ["PACE_EVERY_S", "EVICTED_BY", "Eviction", "ReportingCoordinator", "StragglerReport",
           "StragglerReporter"]

#: The most often the pace record is written (one put; status shows its age).
PACE_EVERY_S = 2.0
#: Who an eviction's drain record names as its requester.
EVICTED_BY = "straggler_policy=evict"


@dataclass(frozen=True)
class StragglerReport:
    """A ``straggler`` event."""

    member_id: str
    host: str
    generation: int
    score: float
    detail: str


@dataclass(frozen=True)
class Eviction:
    """A straggler's graceful leave: its drain record and a ``drain requested`` event."""

    member_id: str
    generation: int
    detail: str


class ReportingCoordinator(Protocol):
    """What the reporter uses of the coordinator: the current registration's writer (None
    while this peer has none: a lost lease, before it registered)."""

    @property
    def writer(self) -> RunWriter | None: ...


class StragglerReporter:
    """One thread that writes what it is handed; see the module docstring."""

    def __init__(self, coordinator: ReportingCoordinator, on_not_evicted: Callable[[], None],
                 pace_every_s: float = PACE_EVERY_S) -> None:
        self._coordinator = coordinator
        self._on_not_evicted = on_not_evicted
        self._pace_every_s = pace_every_s
        self._cv = threading.Condition()
        self._pace: PaceRecord | None = None
        self._pace_due = 0.0  # time.monotonic() when the next pace record may be written
        self._reports: list[StragglerReport] = []
        self._evictions: list[Eviction] = []
        self._stopped = False
        self._thread: threading.Thread | None = None

    def offer_pace(self, record: PaceRecord) -> None:
        with self._cv:
            self._pace = record
            self._wake()

    def report(self, report: StragglerReport) -> None:
        with self._cv:
            self._reports.append(report)
            self._wake()

    def evict(self, eviction: Eviction) -> None:
        with self._cv:
            self._evictions.append(eviction)
            self._wake()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the writes already handed over (bounded)."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _wake(self) -> None:
        if self._stopped:
            return
        if self._thread is None:
            self._thread = threads.start(self._write_loop, "straggler-reporter")
        self._cv.notify()

    def _ready(self) -> bool:
        return bool(self._reports or self._evictions or self._stopped
                    or (self._pace is not None and time.monotonic() >= self._pace_due))

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready():
                    wait = None if self._pace is None else self._pace_due - time.monotonic()
                    self._cv.wait(wait)
                reports, self._reports = self._reports, []
                evictions, self._evictions = self._evictions, []
                pace = None
                if self._pace is not None and time.monotonic() >= self._pace_due:
                    pace, self._pace = self._pace, None
                    self._pace_due = time.monotonic() + self._pace_every_s
                stopped = self._stopped
            for report in reports:
                self._write_report(report)
            for eviction in evictions:
                self._write_eviction(eviction)
            if pace is not None:
                self._write_pace(pace)
            if stopped:
                return

    def _writer(self) -> RunWriter | None:
        writer = self._coordinator.writer
        if writer is None:
            log.info("straggler: this peer has no registration now; a write is dropped")
        return writer

    def _write_pace(self, record: PaceRecord) -> None:
        writer = self._writer()
        if writer is None:
            return
        try:
            writer.client.put(writer.keys.pace, encode(record), writer.run_lease)
        except (EtcdError, RecordError) as exc:
            log.debug("pace not recorded: %s", exc)

    def _write_report(self, report: StragglerReport) -> None:
        writer = self._writer()
        if writer is None:
            return
        rec = EventRecord(kind="straggler", member_id=report.member_id,
                          generation=report.generation, detail=report.detail,
                          unix=time.time(), host=report.host, score=report.score)
        try:
            writer.client.put(writer.keys.event(writer.member_id), encode(rec),
                              writer.run_lease)
        except EtcdError as exc:
            log.warning("straggler event not recorded: %s", exc)

    def _write_eviction(self, eviction: Eviction) -> None:
        writer = self._writer()
        if writer is None:
            self._on_not_evicted()
            return
        key = writer.keys.drain(eviction.member_id)
        drain = encode(DrainRecord(member_id=eviction.member_id, requested_by=EVICTED_BY,
                                   unix=time.time()))
        event = EventRecord(kind="drain requested", member_id=eviction.member_id,
                            generation=eviction.generation, unix=time.time(),
                            detail=f"by {EVICTED_BY}: {eviction.detail}")
        try:
            ok, found = writer.client.txn(
                [Txn.version(key) == 0],
                [Txn.put(key, drain, writer.run_lease),
                 Txn.put(writer.keys.event(writer.member_id), encode(event), writer.run_lease)],
                [Txn.get(key)])
        except EtcdError as exc:
            log.warning("straggler: the eviction of %s was not written: %s",
                        eviction.member_id, exc)
            self._on_not_evicted()
            return
        # A retried transaction whose first attempt was applied finds our own record.
        if not ok and not holds(found, drain):
            log.warning("straggler: %s is already being drained; no eviction written",
                        eviction.member_id)
            self._on_not_evicted()
