"""A reset vote that rides on a gradient all-reduce: :func:`peer_elastic.DistributedOptimizer`'s,
or DDP's with :func:`peer_elastic.allreduce_hook` (:mod:`peer_elastic.ddp_hook`).

``check_host_updates()`` must make every rank raise at the same call, which needs one
agreed bit per check: "does some rank know of a newer generation (or must stop)?". On its
own that bit costs a collective per check (:mod:`peer_elastic.torch.check.pending_check`), and on
a busy machine that collective is most of a check's cost and several percent of a small
step. A job whose gradients are averaged by ``DistributedOptimizer`` already runs a SUM
all-reduce every step on every rank, so the bit rides along for free: each rank appends one
element to the last flattened gradient bucket, 1 when it wants a reset and 0 otherwise, and
the summed element (divided by the world size with the gradients) is positive exactly when
some rank wants one: every rank's answer. The next check takes it instead of running its
own exchange.

Why it is agreed: every rank makes the same optimizer steps and the same checks in the same
order (both are collective), plans the same buckets (the plan depends only on sizes, dtypes
and devices), and so every rank either has a vote of its current group to take at a check
or has none, and when it has one, it is the same number everywhere. A vote is dropped
unread when it belongs to another group (a reset happened since it was cast).

One job: carry the vote from the optimizer to the check. The run loop (``Peer.run``) makes
one :class:`ResetVote` current while the training function runs; outside it, the optimizer
averages gradients alone. The counted element stays a tensor until a check reads it, so a
CUDA step is not synchronized by the vote (the check reads it with ``.item()``, as the
exchange it replaces does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Ballot", "ResetVote", "current_vote", "voting"]


@dataclass(frozen=True)
class Ballot:
    """What this rank puts into the gradient all-reduce: its group and its wish."""

    group: object  # the FormedGroup the optimizer step runs in (compared by identity)
    wants_reset: bool


class ResetVote:
    """The latest counted vote of the current group, until a check takes it."""

    def __init__(self, ballot: Callable[[], Ballot | None]) -> None:
        # Returns None while this peer is in no group (nothing to vote in).
        self._ballot = ballot
        # The group of the latest counted vote and the step's reduced bucket, whose last
        # element is the vote (two attributes, not a record: this is set on every step).
        self._group: object = None
        self._bucket: torch.Tensor | None = None
        # The ballot cast_until_taken() keeps until the next take (or clear).
        self._kept: Ballot | None = None

    def cast(self) -> Ballot | None:
        """This rank's ballot for the all-reduce about to run, or None (no group)."""
        return self._ballot()

    def cast_until_taken(self) -> Ballot | None:
        """Like :meth:`cast`, but the same ballot every time until the next :meth:`take`.

        For carriers whose all-reduces can be in flight together and complete in any order
        (two DDP wrappers in one backward pass, each with a rider bucket): the vote counted
        last then differs between ranks, so every carrier must carry the same ballot for the
        sums, and whichever of them counts last, to be the same everywhere. The cost: a wish
        that arises after the first carrier since the previous check waits for the check
        after the next one."""
        ballot = self._ballot()
        kept = self._kept
        if kept is not None and ballot is not None and kept.group is ballot.group:
            return kept
        self._kept = ballot
        return ballot

    def counted(self, ballot: Ballot, bucket: torch.Tensor) -> None:
        """The all-reduce of ``ballot``'s step completed. The last element of ``bucket`` is
        every rank's ballot element summed, maybe scaled by a positive factor (the averaging
        divides the whole bucket by the world size): positive exactly when some rank wanted
        a reset. Kept as is, not copied: nothing writes to that element after the all-reduce
        (the averaged gradients, views of the bucket from then on, all end before it), and
        on the step's hot path, with the caches cold, even a one-element copy cost
        measurably."""
        self._group, self._bucket = ballot.group, bucket

    def take(self, group: object) -> bool | None:
        """Whether some rank of ``group`` wanted a reset at the last optimizer step since the
        previous take; None when no step voted in ``group`` since then."""
        bucket, counted_in = self._bucket, self._group
        self._group = self._bucket = self._kept = None
        if bucket is None or counted_in is not group:
            return None
        return bool(bucket[-1].item() > 0)

    def clear(self) -> None:
        self._group = self._bucket = self._kept = None


_current: ResetVote | None = None


def current_vote() -> ResetVote | None:
    """The vote of the peer whose training function runs in this process, if any."""
    return _current


@contextmanager
def voting(vote: ResetVote) -> Iterator[ResetVote]:
    """Make ``vote`` current while the training function runs (one peer runs at a time)."""
    global _current
    previous, _current = _current, vote
    try:
        yield vote
    finally:
        _current = previous
        vote.clear()
