"""Per-peer slowness scores from the paces the group exchanged.

Every rank holds the same :class:`GroupPace` after an exchange (the values of one
all-reduce), so every rank computes the same scores from it.

* A peer's **own time** is its time per check outside the waits on other peers (its
  forward, backward, data loading, optimizer step); its **wait** is the rest.
* Its **score** is its own time over the median own time of the *other* peers, in the
  spirit of NVRx's relative performance score (NVRx reports the inverse, fastest = 1): 1 is
  the group's pace, 3 is a peer that takes three times as long for its part of a step. The
  median of the others, not of all: with two peers, the median of both would halve a
  straggler's score. The median is taken as at least :data:`MIN_SHARE` of the step time,
  so that in a step that is nearly all communication, small differences of a small own
  time do not read as large ratios.
* The **step time** is the median over peers of own time + wait (in a synchronous group
  every peer's step takes about as long: the slow one works, the others wait).
* The **expected step time without peer i** is the slowest other peer's own time plus the
  smallest wait of any peer (the slowest peer's wait: the communication itself, which it
  does not spend waiting on anyone). It assumes the communication costs the same with one
  peer fewer, which holds for ring and tree all-reduces of the same gradients.

Nothing here imports torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["MIN_SHARE", "GroupPace"]

#: The smallest median own time a score divides by, as a share of the step time.
MIN_SHARE = 0.1


@dataclass(frozen=True)
class GroupPace:
    """Every rank's pace per check (index = rank), as the group exchanged it."""

    own_s: tuple[float, ...]
    waited_s: tuple[float, ...]
    checks: int  # intervals the values average over (0: nothing measured yet)

    def __post_init__(self) -> None:
        if len(self.own_s) != len(self.waited_s) or not self.own_s:
            raise ValueError("one own time and one wait per rank, at least one rank")

    @property
    def size(self) -> int:
        return len(self.own_s)

    @property
    def measured(self) -> bool:
        return self.checks > 0

    @property
    def step_s(self) -> float:
        """The step time: the median over ranks of own time + wait."""
        return statistics.median(o + w for o, w in zip(self.own_s, self.waited_s, strict=True))

    def scores(self) -> tuple[float, ...]:
        """Every rank's score (1.0 for a group of one: nobody to compare with)."""
        if self.size == 1:
            return (1.0,)
        floor = max(MIN_SHARE * self.step_s, 1e-9)
        out = []
        for i, own in enumerate(self.own_s):
            others = self.own_s[:i] + self.own_s[i + 1:]
            out.append(own / max(statistics.median(others), floor))
        return tuple(out)

    def slowest(self) -> int:
        """The rank with the highest score (the lowest such rank on a tie)."""
        scores = self.scores()
        return max(range(self.size), key=lambda i: (scores[i], -i))

    def expected_step_without(self, rank: int) -> float:
        """The step time expected once ``rank`` is gone (module docstring)."""
        if self.size == 1:
            return self.step_s
        others = self.own_s[:rank] + self.own_s[rank + 1:]
        return max(others) + min(self.waited_s)
