"""How long a thread waited on other peers, and how long it did exempt work.

A straggler's score (:mod:`peer_elastic.straggler`) splits the time between two checks
into the peer's own work and its waits on the other peers. The waits are taken where
peer-elastic knows it waits:

* the spans the training thread marks as waits on its peers (:mod:`peer_elastic.liveness`:
  the check's and the commit's exchanges, the state sync, and whatever the script marks
  with ``Peer.waiting_on_peers()``);
* ``DistributedOptimizer``'s gradient all-reduces (:mod:`peer_elastic.optim`).

Work marked exempt (``Peer.hang_exempt()``: a checkpoint of the script's own, rank 0's
staging copy of a durable snapshot) is counted apart: it is neither the step's work nor a
wait, and one rank doing more of it is no straggler.

Nested spans count once (the outermost), and a span still open counts up to now. One
:class:`Tally` per thread (``threading.local``): the training thread's totals are its own,
whatever other threads (or other peers of the same process) do, and each tally is written
and read by its own thread only, so it needs no lock. Entering and leaving a span costs a
clock read and a few attribute writes.

Nothing here imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Tally", "Totals", "tally"]


class Totals(NamedTuple):
    """A thread's running totals, in seconds since its tally began (a tuple: read at
    every check, where a dataclass's construction would be the costliest part)."""

    waited_s: float
    exempt_s: float


class Tally:
    """One thread's time in waits on other peers and in exempt work."""

    __slots__ = ("_clock", "_exempt_depth", "_exempt_since", "_exempted", "_wait_depth",
                 "_wait_since", "_waited")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._wait_depth = 0
        self._wait_since = 0.0
        self._waited = 0.0
        self._exempt_depth = 0
        self._exempt_since = 0.0
        self._exempted = 0.0

    def enter_wait(self) -> None:
        if self._wait_depth == 0:
            self._wait_since = self._clock()
        self._wait_depth += 1

    def leave_wait(self) -> None:
        if self._wait_depth == 0:
            return  # unbalanced (a span entered before the tally began): nothing to close
        self._wait_depth -= 1
        if self._wait_depth == 0:
            self._waited += self._clock() - self._wait_since

    def enter_exempt(self) -> None:
        if self._exempt_depth == 0:
            self._exempt_since = self._clock()
        self._exempt_depth += 1

    def leave_exempt(self) -> None:
        if self._exempt_depth == 0:
            return
        self._exempt_depth -= 1
        if self._exempt_depth == 0:
            self._exempted += self._clock() - self._exempt_since

    def totals(self) -> Totals:
        """The totals so far, open spans counted up to now."""
        waited, exempted = self._waited, self._exempted
        if self._wait_depth or self._exempt_depth:  # rare: a check inside a marked span
            now = self._clock()
            if self._wait_depth:
                waited += now - self._wait_since
            if self._exempt_depth:
                exempted += now - self._exempt_since
        return Totals(waited, exempted)


_local = threading.local()


def tally() -> Tally:
    """The calling thread's tally (made at its first use)."""
    found: Tally | None = getattr(_local, "tally", None)
    if found is None:
        found = _local.tally = Tally()
    return found
