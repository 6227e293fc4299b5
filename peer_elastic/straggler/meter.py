"""This rank's own pace between exchanges: its own work and its waits on the others.

The time between two exchanges of paces (:mod:`peer_elastic.straggler.exchange`) splits
into what this rank waited on other peers, what it did exempt work
(:mod:`peer_elastic.straggler.waits`), and the rest: its own work in the steps (forward,
backward, data loading, the optimizer, anything the script does between checks). A slow
peer's own work takes longer; the others then wait longer in the collectives that follow.

The meter reads the clock and the training thread's tally only where a span begins and
where it is taken (at the checks that exchange, about once a second), never at the checks
in between: right after a training step, with the caches cold, even a clock read and a
call cost microseconds (measured: 18 µs for a per-check reading on the 2-core test
machine), and the sums need only the ends of the span. Each rank proposes how many checks
the next span has (:meth:`PaceMeter.proposal`), from the mean interval of the span it just
took.

One job: clock the spans. No collective, no torch; a fake clock and a fake tally test it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from peer_elastic.straggler import waits

__all__ = ["EXCHANGE_EVERY_S", "MAX_PERIOD", "PaceMeter", "PaceSample"]

#: About how often the group exchanges its paces (an all-reduce of a few integers per rank,
#: completed at the next exchange).
EXCHANGE_EVERY_S = 1.0
#: The most checks between two exchanges (a script that checks every microsecond).
MAX_PERIOD = 1_000_000


@dataclass(frozen=True)
class PaceSample:
    """This rank's sums over a span of checks."""

    own_s: float  # its own work
    waited_s: float  # its waits on the other peers
    checks: int  # the check intervals in the span (every rank alike)


class PaceMeter:
    """Clocks spans of checks on the thread that calls it; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 tally_of: Callable[[], waits.Tally] = waits.tally) -> None:
        self._clock = clock
        self._tally_of = tally_of
        self._tally: waits.Tally | None = None
        self._since: float | None = None  # the span's start, None: no span
        self._waited = 0.0  # the tally's totals at the span's start
        self._exempt = 0.0
        self._interval_s: float | None = None  # the mean interval of the last span

    def start(self, fresh: bool = True) -> None:
        """Begin a span at this check, on the calling thread. ``fresh`` (a new group):
        forget the interval too, so the first proposal is 1."""
        self._tally = self._tally_of()
        self._since = self._clock()
        self._waited, self._exempt = self._tally.totals()
        if fresh:
            self._interval_s = None

    def take(self, checks: int) -> PaceSample:
        """The span since :meth:`start` or the last take, of ``checks`` check intervals,
        and begin the next one here."""
        if self._since is None or self._tally is None:
            self.start()
            return PaceSample(0.0, 0.0, 0)
        now = self._clock()
        waited, exempt = self._tally.totals()
        elapsed = now - self._since
        wait = waited - self._waited
        own = elapsed - wait - (exempt - self._exempt)
        if checks > 0:
            self._interval_s = elapsed / checks
        self._since, self._waited, self._exempt = now, waited, exempt
        return PaceSample(own if own > 0.0 else 0.0, wait, checks)

    def proposal(self, every_s: float = EXCHANGE_EVERY_S) -> int:
        """How many checks this rank proposes until the next exchange: about ``every_s``
        at the mean interval of the span last taken (1 before any). That span's mean, not
        a longer average: when a peer slows down, its checks come further apart, and the
        next period must shrink at once, or its slowness is seen late."""
        interval = self._interval_s
        if interval is None or interval <= 0:
            return 1
        # 1 / 0.1 is 10.000000000000002: without the epsilon, 11
        return max(1, min(MAX_PERIOD, math.ceil(every_s / interval - 1e-9)))
