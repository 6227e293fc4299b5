"""Telling a fresh run from one whose every holder of the training state was lost.

The state lives only in the peers' memory (and in durable snapshots, where configured). A
group in which no rank holds committed state (every claim at the initial
:class:`~peer_elastic.state.agreement.StateVersion`) is the first group of a run, or what is left
after every peer that held the state died at once while others lived: the whole roster
killed with standbys waiting, a host cut off that carried every trained peer. Those two look
the same to the group, and the second must not pass in silence: training would start again
from the initial state (or from a durable snapshot) and the user would only notice the epoch
counter going back.

So rank 0 says in etcd that the state has commits (:class:`StateMarker`, at most once a
second while it commits; ``<run>/state``), and a group that forms with no holder reads it
from the watched view (:func:`lost_state`): if the run's state had commits, every rank logs
an error and rank 0 records a ``state_lost`` event naming what was lost and where training
goes on from.

One job: the rule and the throttle. No etcd, no torch: the caller writes and reads the record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from peer_elastic.records import StateRecord
from peer_elastic.state.agreement import StateVersion

__all__ = ["MARK_PERIOD_S", "LostState", "StateMarker", "lost_state"]

#: The most often rank 0 says how many commits the state has.
MARK_PERIOD_S = 1.0


@dataclass(frozen=True)
class LostState:
    """The run's state had commits and no rank of the new group holds any of them."""

    commits: int  # commits the run's state had (as of rank 0's last mark)
    generation: int  # the generation that made the last of them
    holder: str  # the member id of the rank 0 that said so
    resumed_commits: int  # commits of the durable snapshot resumed from; 0: none
    # The group went on from a version held in memory, older than the run's state (a peer
    # parked while the others trained on, then every one of those lost).
    held_commits: int | None = None

    def describe(self) -> str:
        if self.held_commits is not None:
            return (f"the newest training state any peer of this group holds has "
                    f"{self.held_commits} commits, but the run's state had at least "
                    f"{self.commits} (recorded in generation {self.generation} by rank 0 "
                    f"{self.holder}): every peer that held the newer state is gone, and no "
                    f"durable snapshot newer than the held state could be loaded; training "
                    f"goes on from the held state and the commits after it are redone")
        # The record is rewritten at most once a second: a lower bound, which a snapshot
        # written since may pass.
        lost = (f"no peer of this group holds the run's newest training state: every peer "
                f"that held it is gone (it had at least {self.commits} commits, as recorded in "
                f"generation {self.generation} by rank 0 {self.holder})")
        if self.resumed_commits:
            return (f"{lost}; resumed from the newest durable snapshot, at "
                    f"{self.resumed_commits} commits; the commits after it are redone")
        return (f"{lost}; training starts again from the state the training script built "
                f"(set snapshot_dir to resume from durable snapshots instead)")


def lost_state(mark: StateRecord | None, agreed: StateVersion,
               held: bool = False) -> LostState | None:
    """Asked when a group has agreed on its state: what was lost, if anything.

    ``agreed`` is the version the group went on with. Not ``held`` (the group resumed a
    snapshot or starts from the initial state, because no rank held trained state or a
    snapshot was newer): lost if the run's ``mark`` says its state had commits (None: the
    first group of a run). ``held`` (a version some rank held in memory): lost only if the
    mark was made by a later generation than the one that produced ``agreed`` and counts
    more commits, i.e. others trained past the held state and are gone. The mark lags
    commits by up to a second, so a holder is never wrongly called behind it.
    """
    if mark is None:  # a record read back always has commits (records.py refuses 0)
        return None
    if not held:
        return LostState(commits=mark.commits, generation=mark.generation,
                         holder=mark.written_by, resumed_commits=agreed.commits)
    if mark.commits > agreed.commits and mark.generation > agreed.generation:
        return LostState(commits=mark.commits, generation=mark.generation,
                         holder=mark.written_by, resumed_commits=0,
                         held_commits=agreed.commits)
    return None


class StateMarker:
    """Rank 0's side: hands ``(commits, generation)`` to ``offer`` after a commit, at most
    once per ``period_s`` (the write happens on a background thread; the training thread
    only compares two clock readings)."""

    def __init__(self, offer: Callable[[int, int], None], period_s: float = MARK_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._offer = offer
        self._period = period_s
        self._clock = clock
        self._last: float | None = None

    def committed(self, commits: int, generation: int) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self._period:
            return
        self._last = now
        self._offer(commits, generation)
