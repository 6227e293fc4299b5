"""This rank's own pace between checks: its own work and its waits on the others.

At each check (``commit()``, ``check_host_updates()``) the time since the previous check
splits into what this rank waited on other peers and what it did exempt work
(:mod:`peer_elastic.straggler.waits`), and the rest: its own work in the step (forward,
backward, data loading, the optimizer, anything the script does between checks). A slow
peer's own work takes longer; the others then wait longer in the collectives that follow.

The sums since the last exchange are handed to the group's exchange
(:mod:`peer_elastic.straggler.exchange`) about every :data:`EXCHANGE_EVERY_S`: each rank
proposes how many checks that is, from its running average of the time between checks.

One job: clock the checks. No collective, no torch; a fake clock and fake totals test it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from peer_elastic.straggler import waits

__all__ = ["EXCHANGE_EVERY_S", "MAX_PERIOD", "PaceMeter", "PaceSample"]

#: About how often the group exchanges its paces (a blocking all-reduce of a few integers
#: per rank: at about 0.2 ms on the 2-core test machine, 0.02 % of the time).
EXCHANGE_EVERY_S = 1.0
#: The most checks between two exchanges (a script that checks every microsecond).
MAX_PERIOD = 1_000_000


@dataclass(frozen=True)
class PaceSample:
    """This rank's sums over the checks since the last exchange."""

    own_s: float  # its own work
    waited_s: float  # its waits on the other peers
    checks: int  # intervals measured (the checks since the last exchange, every rank alike)


class PaceMeter:
    """Clocks the intervals between this rank's checks; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 totals: Callable[[], waits.Totals] | None = None) -> None:
        self._clock = clock
        self._totals = totals if totals is not None else lambda: waits.tally().totals()
        self._last_at: float | None = None
        self._last_waited = 0.0
        self._last_exempt = 0.0
        self._own = 0.0
        self._waited = 0.0
        self._checks = 0
        self._span_start: float | None = None  # the first check of the current sums
        self._interval_s: float | None = None  # the mean interval of the last sample

    def restart(self) -> None:
        """A new group: the next check starts the first interval afresh (the time since
        the last check of the old group went to the reset, not to a step)."""
        self._last_at = self._span_start = None
        self._own = self._waited = 0.0
        self._checks = 0
        self._interval_s = None

    def check(self) -> None:
        """A check: close the interval since the previous one."""
        now = self._clock()
        waited, exempt = self._totals()
        if self._last_at is not None:
            interval = now - self._last_at
            wait = waited - self._last_waited
            own = interval - wait - (exempt - self._last_exempt)
            self._own += own if own > 0.0 else 0.0
            self._waited += wait
            self._checks += 1
        if self._span_start is None:
            self._span_start = now
        self._last_at, self._last_waited, self._last_exempt = now, waited, exempt

    def take(self) -> PaceSample:
        """The sums since the last take, and start new ones."""
        sample = PaceSample(self._own, self._waited, self._checks)
        if self._checks and self._span_start is not None and self._last_at is not None:
            self._interval_s = (self._last_at - self._span_start) / self._checks
        self._span_start = self._last_at
        self._own = self._waited = 0.0
        self._checks = 0
        return sample

    def proposal(self, every_s: float = EXCHANGE_EVERY_S) -> int:
        """How many checks this rank proposes until the next exchange: about ``every_s``
        at the mean interval of the sample last taken (1 before any). The mean of the last
        sample, not a longer average: when a peer slows down, its checks come further
        apart, and the next period must shrink at once, or its slowness is seen late."""
        interval = self._interval_s
        if interval is None or interval <= 0:
            return 1
        return max(1, min(MAX_PERIOD, math.ceil(every_s / interval - 1e-9)))  # 1 / 0.1 = 10.000...1
