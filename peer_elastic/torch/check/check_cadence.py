"""How many plain checks pass between two generation exchanges.

The exchange of :mod:`peer_elastic.torch.check.pending_check` costs one gloo all-reduce issued and
completed: about 0.2 ms on the 2-core test machine. At every check that is 2-3 % of an
8 ms step and 10 % of a 2 ms one. So a plain check exchanges only every ``P``-th time, where
``P`` is the smallest period any rank of the group proposes, agreed through the exchange
itself (:class:`~peer_elastic.torch.check.pending_check.PendingResult`):

* each rank proposes enough checks that its exchanges cost at most :data:`BUDGET` of the
  time between its checks,
* but no more than fit in :data:`MAX_DELAY_S` of them, so a change waits at most that long
  (twice, issue and completion) beyond what an exchange at every check takes to act on it.

Checks 20 ms or more apart (:data:`MAX_DELAY_S`) keep ``P = 1``: an exchange at every check.
Every rank makes the same sequence of check calls (the contract) and ``P`` comes from a
completed exchange, the same value on every rank, so every rank exchanges at the same calls
and all still raise together. The first exchange of a group runs at its first check.

One job: count the checks and time them; it runs no collective and knows no group.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["BUDGET", "MAX_DELAY_S", "CheckCadence"]

#: The share of the time between checks that exchanges may cost (when they can be spaced).
BUDGET = 0.005
#: The most time between two exchanges of one rank: a change is acted on at most twice this
#: later than with an exchange at every check.
MAX_DELAY_S = 0.02
#: Weight of the newest sample in the running averages (of check intervals, exchange costs).
_ALPHA = 0.2


class CheckCadence:
    """Decides which plain checks exchange; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._skips_left = 0
        self._last_call: float | None = None
        self._interval_s: float | None = None  # running average between due() calls
        self._cost_s: float | None = None  # running average of one exchange

    def due(self) -> bool:
        """Called at each plain check while an exchange is pending: True when this check
        completes it (and issues the next)."""
        now = self._clock()
        if self._last_call is not None:
            self._interval_s = _average(self._interval_s, now - self._last_call)
        self._last_call = now
        if self._skips_left > 0:
            self._skips_left -= 1
            return False
        return True

    def proposal(self) -> int:
        """The period this rank proposes for the group's next exchanges."""
        if self._interval_s is None or self._cost_s is None or self._interval_s <= 0:
            return 1
        wanted = math.ceil(self._cost_s / (BUDGET * self._interval_s))
        most = math.floor(MAX_DELAY_S / self._interval_s + 1e-9)  # 0.02 / 0.002 is 9.99...
        return max(1, min(wanted, most))

    def exchanged(self, cost_s: float, period: int) -> None:
        """An exchange cost this rank ``cost_s``; the next is due in ``period`` checks (the
        group's agreed period; 1 for the first exchange of a group)."""
        self._cost_s = _average(self._cost_s, cost_s)
        self._skips_left = max(0, period - 1)


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + _ALPHA * (sample - old)
