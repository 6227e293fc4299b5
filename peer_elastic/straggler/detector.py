"""When a slow peer is a straggler: its score at or above the threshold for a whole window.

A peer judges itself (:mod:`peer_elastic.straggler.watch`), from the scores every rank
derives alike from each exchange of paces. :class:`StragglerDetector` takes its score at
each exchange and answers with a :class:`Verdict`:

* for ``straggler_cooldown_s`` after the group formed, nothing is judged (``UNJUDGED``):
  a new group's first steps (compilation, caches, a joiner's data loader) are slow for
  reasons that pass;
* a score at or above ``straggler_threshold`` starts a run of slow measurements
  (``SLOW``), and the run holds while the score stays above the *holding level*, halfway
  between 1 (the group's pace) and the threshold: 1.5 at the default threshold of 2. The
  second measurement in a row at or under it ends the run. Why not one measurement under
  the threshold: a measurement is a second of a busy machine, and a peer at a third of the
  others' speed measured, on the 2-core test machine under a load of 15, 2.95, 1.88, 0.97,
  3.90, 3.86, 1.96, 3.02, ...: each dip restarted the window, and it was never found. A
  peer back at the group's pace (about 1) ends the run one measurement later;
* a run that lasts ``straggler_window_s`` makes the peer a straggler (``STRAGGLING``), for
  as long as it lasts; its score is then the median of the run's (one measurement can be
  anything from the holding level up). The first such verdict of an *episode* is marked
  ``new_episode``: that is the one the event log gets. The episode ends only once the
  score stayed under the holding level for a whole window, so a peer that slows down now
  and then is reported once, not at every bout.

A run dates from the start of the span its first slow measurement covers (the
measurement says the peer was slow over that span, and its answer comes a check after the
span ended), not from before the cooldown's end. So a slowdown longer than the window is
found at the first answer a window after the start of its first slow span: within about a
measurement of the window, before or after it (the span that holds the slowdown's start
counts whole when it scores slow; measurements come about once a second:
:data:`peer_elastic.straggler.meter.EXCHANGE_EVERY_S`). A slowdown shorter than the window
by more than about three measurements (that span, the one it ends in, a dip) is never a
straggler, whatever its size.

One job: that rule, on a clock it is given (a fake one in the tests). No torch, no etcd.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass

from peer_elastic.straggler.settings import StragglerSettings

__all__ = ["Pace", "StragglerDetector", "Verdict", "holding_level"]

#: The most recent scores of a run kept for its median (a window of an hour, at one a
#: second: more would only cost memory).
_RUN_SCORES = 3600


def holding_level(threshold: float) -> float:
    """The score above which a run of slow measurements holds (module docstring)."""
    return 1.0 + (threshold - 1.0) / 2.0


class Pace(enum.Enum):
    UNJUDGED = "unjudged"  # within the cooldown after the group formed
    STEADY = "steady"  # below the threshold
    SLOW = "slow"  # at or above it, for less than the window
    STRAGGLING = "straggling"  # at or above it for the whole window


@dataclass(frozen=True)
class Verdict:
    pace: Pace
    score: float  # this measurement's; STRAGGLING: the median of the run's (what to report)
    slow_since: float | None = None  # when this run of slow measurements began
    new_episode: bool = False  # the first STRAGGLING verdict of its episode


class StragglerDetector:
    """Judges one peer's scores in one group; see the module docstring."""

    def __init__(self, started_at: float) -> None:
        self._started_at = started_at  # when the group formed (its first check)
        self._slow_since: float | None = None
        self._run: list[float] = []  # the scores of the run (for its median)
        self._dipped = False  # the run's last measurement was at or under the holding level
        self._in_episode = False
        self._steady_since: float | None = None  # under the holding level, in an episode

    def forget(self) -> None:
        """Drop the current run and episode (the policy was switched off); the cooldown
        stays counted from the group's start."""
        self._slow_since = self._steady_since = None
        self._in_episode = self._dipped = False

    def observe(self, now: float, score: float, settings: StragglerSettings,
                since: float | None = None) -> Verdict:
        """The verdict on ``score``, known at ``now`` and measured over the span that began
        at ``since`` (None: at ``now``), on the clock given to the start. A run of slow
        measurements dates from the start of its first one's span, never from before the
        cooldown's end."""
        if now - self._started_at < settings.cooldown_s:
            self._slow_since = self._steady_since = None
            self._dipped = False
            return Verdict(Pace.UNJUDGED, score)
        holds = score > holding_level(settings.threshold)
        if self._slow_since is not None and not holds and not self._dipped:
            self._dipped = True  # the first dip of a run: it goes on, but not twice in a row
            self._run.append(score)
            return Verdict(Pace.SLOW, score, self._slow_since)
        if score >= settings.threshold or (self._slow_since is not None and holds):
            self._dipped = False
            self._steady_since = None
            if self._slow_since is None:
                began = now if since is None else min(since, now)
                self._slow_since = max(began, self._started_at + settings.cooldown_s)
                self._run = []
            self._run.append(score)
            del self._run[:-_RUN_SCORES]
            if now - self._slow_since < settings.window_s:
                return Verdict(Pace.SLOW, score, self._slow_since)
            new = not self._in_episode
            self._in_episode = True
            return Verdict(Pace.STRAGGLING, statistics.median(self._run), self._slow_since,
                           new_episode=new)
        self._slow_since = None
        self._dipped = False
        if holds:
            self._steady_since = None  # between the two levels: not slow, nor back at pace
            return Verdict(Pace.STEADY, score)
        if self._in_episode:
            if self._steady_since is None:
                self._steady_since = now
            if now - self._steady_since >= settings.window_s:
                self._in_episode = False
                self._steady_since = None
        return Verdict(Pace.STEADY, score)
