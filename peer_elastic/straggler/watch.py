"""A peer's straggler watch: the hooks its checks call.

:class:`StragglerWatch` is what :class:`~peer_elastic.elastic.Peer` holds. At every check
(:meth:`~StragglerWatch.at_check`, a count) it counts the check; about once a second the
check also runs the group's exchange of paces (:meth:`~StragglerWatch.exchange`: it
completes the all-reduce the last exchange issued and issues the next, at the same checks
on every rank: :mod:`peer_elastic.straggler.exchange`). From the agreed paces every rank
computes every rank's score
(:mod:`peer_elastic.straggler.score`), and then:

* rank 0 hands the paces of the whole roster to the reporter (the pace record that
  ``status`` and the dashboard show);
* each rank judges *itself* (:mod:`peer_elastic.straggler.detector`): the only writer of a
  peer's ``straggler`` event and of its eviction is the peer itself, so no two ranks can
  ever decide differently about one peer, and no peer is written about twice. Once it is a
  straggler it decides (:mod:`peer_elastic.straggler.policy`) and hands the event, and an
  eviction, to the reporter (:mod:`peer_elastic.straggler.reporting`).

An evicted peer leaves like a drained one: it raises ``LeaveRequested`` once the job
re-formed without it, and :attr:`~StragglerWatch.exit_code` is then :data:`EXIT_STRAGGLER`
instead of 0, so that a scheduler can tell it apart and replace the host.

A new group (a new ``FormedGroup``, seen at its first check) starts everything afresh: the
meter, the exchange's period (an op of the old group is dropped unread), the detector and
its cooldown. When the training function returns, :meth:`~StragglerWatch.settle` completes
the op in flight; a peer leaving its group drops it.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.records import JobConfig, PaceRecord, PeerPace
from peer_elastic.straggler.detector import Pace, StragglerDetector, Verdict
from peer_elastic.straggler.exchange import PaceExchange
from peer_elastic.straggler.meter import PaceMeter
from peer_elastic.straggler.policy import EXIT_STRAGGLER, Action, Decision, decide
from peer_elastic.straggler.reporting import (
    Eviction,
    ReportingCoordinator,
    StragglerReport,
    StragglerReporter,
)
from peer_elastic.straggler.score import GroupPace
from peer_elastic.straggler.settings import StragglerPolicy, StragglerSettings
from peer_elastic.torch.formed_group import FormedGroup
from peer_elastic.torch.group import is_collective_failure

log = logging.getLogger(__name__)

__all__ = ["StragglerCoordinator", "StragglerWatch"]


class StragglerCoordinator(ReportingCoordinator, Protocol):
    """What the watch uses of the coordinator: this peer's names, the job's settings (the
    policy's, read at each verdict: ``set`` changes them at run time), the watched view (to
    find whom an eviction leaves), and what the reporter writes through."""

    member_id: str
    host: str
    config: JobConfig

    def snapshot(self) -> ViewSnapshot: ...


class StragglerWatch:
    """Measures this peer's pace, exchanges it, judges and acts; see the module docstring."""

    def __init__(self, coordinator: StragglerCoordinator,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._coordinator = coordinator
        self._clock = clock
        self._meter = PaceMeter()
        self._exchange = PaceExchange()
        self._evicting = threading.Event()  # set from the decision until the drain fails
        self._reporter = StragglerReporter(coordinator, on_not_evicted=self._evicting.clear)
        self._group: FormedGroup | None = None
        self._due_in = 1  # checks until the next exchange (the first check of a group: 1)
        self._counted = 0  # checks since the span began (every rank alike)
        self._resumed = False  # switched on again: a new span at the next check
        self._awaiting = False  # an op was issued at the previous check: complete it now
        # When the span being measured began (the last issue, or the start), on self._clock,
        # and when the span the op in flight carries began: a slow measurement says the peer
        # was slow since its span's start, not since the answer came.
        self._span_began = clock()
        self._in_flight_began = self._span_began
        self._detector = StragglerDetector(clock())
        self._last_action: Action | None = None
        self._enabled = True
        self._pace: GroupPace | None = None
        self._score = math.nan
        self._rank = -1

    # -- what others read -------------------------------------------------------------------------

    @property
    def pace(self) -> GroupPace | None:
        """The group's paces at the last exchange of the current group (None: none yet)."""
        return self._pace

    @property
    def score(self) -> float:
        """This peer's score at the last exchange (NaN: none yet in this group)."""
        return self._score

    @property
    def own_s(self) -> float:
        """This peer's own time per check at the last exchange (NaN: none yet)."""
        pace, rank = self._pace, self._rank
        return pace.own_s[rank] if pace is not None else math.nan

    @property
    def waited_s(self) -> float:
        """This peer's wait on the others per check at the last exchange (NaN: none yet)."""
        pace, rank = self._pace, self._rank
        return pace.waited_s[rank] if pace is not None else math.nan

    @property
    def exit_code(self) -> int:
        """What a peer that leaves the job on request exits with: :data:`EXIT_STRAGGLER`
        when it was evicted as a straggler, else 0."""
        return EXIT_STRAGGLER if self._evicting.is_set() else 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Measure or not (a benchmark's comparison). Every rank must switch at the same
        check. Switched on again, it goes on where it was (the same period, counted only
        over measured checks: the same on every rank); the time while off is not measured."""
        if on and not self._enabled:
            self._resumed = True
        self._enabled = on

    # -- the hooks --------------------------------------------------------------------------------

    def at_check(self, group: FormedGroup) -> bool:
        """A check in ``group`` (a FormedGroup): count it (no clock read: the meter reads
        one at the checks that exchange). True when this check must also run
        :meth:`exchange` (the same checks on every rank)."""
        if not self._enabled:
            return False
        if group is not self._group or self._resumed:
            self._begin(group)
            return False
        self._counted += 1
        self._due_in -= 1
        return self._due_in <= 0 or self._awaiting

    def exchange(self, group: FormedGroup, device: torch.device) -> None:
        """The group's exchange of paces (collective): complete the op the previous check
        issued, if any, and judge; issue the next one when it is due."""
        pace = None
        measured_since = self._in_flight_began
        if self._awaiting:
            self._awaiting = False
            done = self._exchange.complete(group)
            if done is not None:
                # The op was issued one check ago: the next is due `period` checks after it.
                pace, period = done
                self._due_in = period - 1
        if self._due_in <= 0:
            a = group.assignment
            sample, self._counted = self._meter.take(self._counted), 0
            self._exchange.issue(group, a.rank, a.size, sample, self._meter.proposal(),
                                 device)
            self._in_flight_began, self._span_began = self._span_began, self._clock()
            self._awaiting = True
            self._due_in = 1  # until its answer, at the next check, says the period
        if pace is not None and pace.measured:
            self._judged(group, pace, measured_since)

    def _judged(self, group: FormedGroup, pace: GroupPace, since: float) -> None:
        """What every rank does with the paces of a completed exchange, measured over the
        span that began at ``since``."""
        a = group.assignment
        scores = pace.scores()
        log.debug("pace over %d checks: step %.1f ms, scores %s", pace.checks,
                  pace.step_s * 1000, " ".join(f"{x:.2f}" for x in scores))
        self._rank, self._score, self._pace = a.rank, scores[a.rank], pace  # rank first:
        # the metrics thread reads pace.own_s[rank]
        if a.rank == 0:
            self._reporter.offer_pace(_pace_record(a.generation, a.roster, pace, scores))
        self._judge(group, pace, scores[a.rank], since)

    def settle(self) -> None:
        """The training function returned on every rank: complete the op in flight (every
        rank issued it), so the group is never torn down under it. Its answer no longer
        matters, nor does its failure (a peer that died since): the run is over."""
        group, self._awaiting = self._group, False
        try:
            self._exchange.complete(group)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            log.info("the last exchange of paces failed after the run ended: %s", exc)

    def drop(self) -> None:
        """Forget the op in flight (this peer is leaving its group)."""
        self._exchange.drop()
        self._awaiting = False

    def close(self) -> None:
        self.drop()
        self._reporter.stop()

    # -- inside -----------------------------------------------------------------------------------

    def _begin(self, group: FormedGroup) -> None:
        """The first check of a new group (everything afresh: the first exchange is at the
        next check, and agrees on the period), or the first after measuring was switched
        on again (a new span; the period and the rest go on)."""
        self._counted = 0
        self._resumed = False
        self._span_began = self._in_flight_began = self._clock()
        if group is self._group:
            self._meter.start(fresh=False)
            return
        self._group = group
        self._exchange.drop()  # the old group's op, if any: never waited on in this one
        self._awaiting = False
        self._meter.start()
        self._due_in = 1
        self._detector = StragglerDetector(self._clock())
        self._last_action = None
        self._pace, self._score = None, math.nan

    def _judge(self, group: FormedGroup, pace: GroupPace, score: float, since: float) -> None:
        settings = StragglerSettings.of(self._coordinator.config)
        if settings.policy is StragglerPolicy.OFF:
            self._detector.forget()
            return
        verdict = self._detector.observe(self._clock(), score, settings, since=since)
        if verdict.pace is not Pace.STRAGGLING or self._evicting.is_set():
            return
        a = group.assignment
        decision = decide(settings.policy, pace, a.rank, self._remaining(),
                          int(self._coordinator.config.min_np))
        me = self._coordinator.member_id
        detail = _detail(pace, a.rank, verdict, self._clock(), decision)
        if verdict.new_episode:
            log.warning("straggler: %s", detail)
            self._reporter.report(StragglerReport(me, self._coordinator.host, a.generation,
                                                  verdict.score, detail))
        elif decision.action is not self._last_action:
            log.info("straggler: %s", detail)
        self._last_action = decision.action
        if decision.action is Action.EVICT:
            self._evicting.set()  # before the write: the leave it causes must find it set
            self._reporter.evict(Eviction(me, a.generation, detail))

    def _remaining(self) -> int:
        """Peers the next roster would have without this one (standbys included)."""
        me = self._coordinator.member_id
        snap = self._coordinator.snapshot()
        others = sum(1 for m in snap.eligible() if m.id != me)
        cap = int(self._coordinator.config.max_np)
        return min(others, cap) if cap else others


def _detail(pace: GroupPace, rank: int, verdict: Verdict, now: float,
            decision: Decision) -> str:
    """The event's text: how slow, for how long, and what it did."""
    others = pace.own_s[:rank] + pace.own_s[rank + 1:]
    median = statistics.median(others) if others else 0.0
    since = verdict.slow_since
    lasted = f" over {now - since:.0f} s" if since is not None else ""
    return (f"median score {verdict.score:.2f}{lasted}; now its own time "
            f"{pace.own_s[rank] * 1000:.1f} ms per step against "
            f"{median * 1000:.1f} ms for the others; {decision.describe()}")


def _pace_record(generation: int, roster: tuple[str, ...], pace: GroupPace,
                 scores: tuple[float, ...]) -> PaceRecord:
    return PaceRecord(
        generation=generation, unix=time.time(), step_s=pace.step_s,
        peers=[PeerPace(member_id=m, score=s, own_s=o, waited_s=w) for m, s, o, w
               in zip(roster, scores, pace.own_s, pace.waited_s, strict=True)])
