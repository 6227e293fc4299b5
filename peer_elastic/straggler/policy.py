"""What a straggler does about itself: report, or leave when the job is faster without it.

:func:`decide` answers for the peer that the detector found straggling, from the paces
the group agreed on (every rank holds the same) and from the watched view of etcd (how
many peers the next roster would have without it). Under ``straggler_policy=evict`` it
leaves (:attr:`Action.EVICT`) only when all of these hold:

* it is the slowest peer of the group (the highest score; the lowest rank on a tie): with
  two stragglers, one goes at a time, and the other is judged again in the next group;
* the roster without it keeps at least ``min_np`` peers (a standby that would take its
  place counts);
* the job is faster without it. With ``N`` peers now, ``M`` without it, the step time
  ``T`` measured now and ``T'`` the step time expected without it
  (:meth:`~peer_elastic.straggler.score.GroupPace.expected_step_without`), every peer
  trains one batch per step, so the job's throughput is ``N / T`` batches per second now
  and ``M / T'`` without it. It leaves only when ``M / T' > N / T``. A peer at a third of
  the others' speed in a group of 4 takes the job from 4 / 3t to 3 / t batches per
  second: it leaves. A peer 20 % slow does not: 4 / 1.2t is more than 3 / t.

One job: that decision. No torch, no etcd.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from peer_elastic.straggler.score import GroupPace
from peer_elastic.straggler.settings import StragglerPolicy

__all__ = ["EXIT_STRAGGLER", "Action", "Decision", "decide"]

#: Exit status of a peer evicted as a straggler: not 0, so that a scheduler or supervisor
#: sees that its host wants replacing; not 4 (the job failed) nor 5 (a hung training
#: thread). The job goes on without it.
EXIT_STRAGGLER = 7


class Action(enum.Enum):
    REPORT = "report"  # the policy is report: the event, nothing else
    EVICT = "evict"  # leave the job gracefully
    KEEP_NOT_SLOWEST = "keep_not_slowest"  # another peer is slower: it goes first
    KEEP_MIN_NP = "keep_min_np"  # without it the roster would be below min_np
    KEEP_FASTER_WITH = "keep_faster_with"  # the job would be slower without it


@dataclass(frozen=True)
class Decision:
    action: Action
    size: int  # peers in the group now (N)
    remaining: int  # peers the next roster would have without this one (M)
    step_s: float  # the step time now (T)
    expected_step_s: float  # the step time expected without this one (T')
    min_np: int

    @property
    def rate_now(self) -> float:
        """Batches per second the job trains now (``N / T``)."""
        return self.size / self.step_s if self.step_s > 0 else 0.0

    @property
    def rate_without(self) -> float:
        """Batches per second it is expected to train without this peer (``M / T'``)."""
        return self.remaining / self.expected_step_s if self.expected_step_s > 0 else 0.0

    def describe(self) -> str:
        """For people: what it does and why (the event's detail, the log line)."""
        rates = (f"{self.size} peers at {self.step_s * 1000:.1f} ms a step train "
                 f"{self.rate_now:.1f} batches/s; {self.remaining} without it, expected at "
                 f"{self.expected_step_s * 1000:.1f} ms a step, "
                 f"{self.rate_without:.1f} batches/s")
        if self.action is Action.REPORT:
            return "reported (straggler_policy=report)"
        if self.action is Action.EVICT:
            return f"evicted: it leaves gracefully at the next check ({rates})"
        if self.action is Action.KEEP_NOT_SLOWEST:
            return "not evicted: another peer is slower, and goes first"
        if self.action is Action.KEEP_MIN_NP:
            return (f"not evicted: {self.remaining} peers would remain, below "
                    f"min_np={self.min_np}")
        return f"not evicted: the job would be slower without it ({rates})"


def decide(policy: StragglerPolicy, pace: GroupPace, rank: int, remaining: int,
           min_np: int) -> Decision:
    """What straggler ``rank`` of ``pace`` does under ``policy``; ``remaining``: peers the
    next roster would have without it (module docstring)."""
    step = pace.step_s
    expected = pace.expected_step_without(rank)

    def made(action: Action) -> Decision:
        return Decision(action, pace.size, remaining, step, expected, min_np)

    if policy is not StragglerPolicy.EVICT:
        return made(Action.REPORT)
    if pace.slowest() != rank:
        return made(Action.KEEP_NOT_SLOWEST)
    if remaining < max(1, min_np):
        return made(Action.KEEP_MIN_NP)
    if remaining * step <= pace.size * expected:  # M / T' <= N / T, without dividing
        return made(Action.KEEP_FASTER_WITH)
    return made(Action.EVICT)
