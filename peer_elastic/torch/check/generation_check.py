"""The collective half of the per-step check: does every rank of the group reset at this call?

``Peer._check`` (behind ``state.commit()`` and ``state.check_host_updates()``) asks
:meth:`GenerationCheck.run`. A plain check completes the generation exchange the previous
check issued (:mod:`.pending_check`) and issues the next one, so it waits on nobody unless a
rank is behind: every rank completes the same op at the same call and so decides the same
there, one check after a rank first saw the change. When checks come faster than an
exchange is worth, only every P-th plain check exchanges (P agreed by the exchange, the
same on every rank, :mod:`.check_cadence`); the others return at once. When a
``DistributedOptimizer`` step (or a DDP backward pass with ``pe.allreduce_hook``) ran since
the last check, its gradient all-reduce already carried the same bit (:mod:`.reset_vote`):
the check takes that and issues nothing, so it runs no collective at all.

A commit, and a plain check whose completed exchange says a reset is due, need to know
whether some rank holds unmerged progress *now*: they run one blocking all-reduce (MAX) of
[the newest generation this rank wants, does it hold unmerged progress]
(:mod:`.max_exchange`), and the answer (:class:`Verdict`) says whether to merge and
whether to reset. What a rank wants is decided once per change of the facts it reads
(:mod:`peer_elastic.process.memo`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from peer_elastic.etcd.stop import RESET_NOW, MembershipFacts, stop_reason
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.observer import PeerStats
from peer_elastic.process.memo import IdentityMemo
from peer_elastic.torch.check.check_cadence import CheckCadence
from peer_elastic.torch.check.max_exchange import MaxExchange
from peer_elastic.torch.check.pending_check import PendingCheck
from peer_elastic.torch.check.reset_vote import Ballot, ResetVote
from peer_elastic.torch.formed_group import FormedGroup

__all__ = ["GenerationCheck", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What a check that ran the blocking exchange decided, the same on every rank."""

    reset: bool  # every rank raises HostsUpdatedInterrupt at this call
    merge: bool  # some rank holds progress recorded only locally: every rank merges it
    snapshot: ViewSnapshot  # the view the check read (what the interrupt says of the reset)


class GenerationCheck:
    """The per-step check's collectives for one peer; see the module docstring.

    ``waiting``: marks a wait on the other ranks (the hang detector's ``collective``);
    ``device``: where the exchange's buffers live (the backend's); ``group``: the group this
    peer is in now, for the vote an optimizer step casts between two checks.
    """

    def __init__(self, coordinator: MembershipFacts, stats: PeerStats,
                 waiting: Callable[[], AbstractContextManager[None]],
                 device: Callable[[], torch.device],
                 group: Callable[[], FormedGroup | None]) -> None:
        self._coord = coordinator
        self._stats = stats
        self._waiting = waiting
        self._device = device
        self._group = group
        self._exchange: MaxExchange | None = None  # the blocking one (a commit's)
        # The generation exchange a plain check issued, completed at the next check that
        # exchanges: every check, or every P-th when checks come fast (check_cadence).
        self._pending = PendingCheck()
        self._cadence = CheckCadence()
        # Or, in a job averaging gradients with DistributedOptimizer, the same bit carried by
        # the step's gradient all-reduce: then a check runs no collective of its own.
        self.vote = ResetVote(self.ballot)
        # What this rank wants (generation, vote), decided once per change of its facts.
        self._wants: IdentityMemo[tuple[int, Ballot]] = IdentityMemo()

    def run(self, group: FormedGroup, committing: bool,
            local_progress: Callable[[], bool]) -> Verdict | None:
        """The check's collectives in ``group``; None when the check ends here (a plain check
        with no reset due), else the blocking exchange's :class:`Verdict`.
        ``local_progress``: whether this rank holds progress the others do not know yet."""
        current = group.assignment.generation
        # The vote of the optimizer steps since the last check, the same on every rank.
        voted = self.vote.take(group)
        if voted is False and not committing and not self._pending.pending:
            return None  # the step's gradient all-reduce said: nobody wants a reset
        if voted is None and not committing and self._pending.pending \
                and not self._cadence.due():
            self._stats.count("checks_spaced")
            return None  # between two exchanges: the same calls on every rank (check_cadence)
        exchange_t0 = time.perf_counter()
        snap = self._coord.snapshot()
        want = self.wanted(group, snap)[0]
        # Complete the op of the previous check first (also before a commit), so every rank
        # runs the same collectives in the same order.
        with self._waiting():  # waiting here is waiting on the others
            previous = self._pending.complete(group)
        reset_due = previous is not None and previous.newest_generation > current
        reset_due = reset_due or bool(voted)
        device = self._device()
        if not committing and not reset_due:
            if voted is None:  # no step carried the bit: exchange it ourselves
                self._stats.count("check_exchanges")
                self._pending.issue(group, want, device, self._cadence.proposal())
                self._cadence.exchanged(time.perf_counter() - exchange_t0,
                                        previous.period if previous is not None else 1)
            return None
        exchange = self._exchange
        if exchange is None or exchange.device != device:
            exchange = self._exchange = MaxExchange(2, device)
        with self._waiting():
            newest_wanted, someone_local = exchange.run((want, int(local_progress())))
        return Verdict(newest_wanted > current or reset_due, bool(someone_local), snap)

    def want(self, group: FormedGroup, snap: ViewSnapshot) -> int:
        """The generation this rank asks the group to move to (the current one: none)."""
        current = group.assignment.generation
        newest = snap.generation
        want = newest.number if newest is not None else current
        if stop_reason(self._coord, group, snap, causes=RESET_NOW) is not None:
            # Lease lost (we must not go on in this group), a fatal error, or the job ended
            # (e.g. reset limit): everyone stops at the next check and the reset path reports it.
            want = max(want, current + 1)
        return want

    def wanted(self, group: FormedGroup, snap: ViewSnapshot) -> tuple[int, Ballot]:
        """``want(group, snap)``, and the reset vote it makes.

        Asked at every check and every optimizer step. It depends only on the group, the
        watched view's snapshot, the coordinator's fatal error and its registration (what
        ``want`` reads), so while those are the same objects the last answer stands
        (:mod:`peer_elastic.process.memo`): deciding it anew walked the stop causes every step.
        """
        coord = self._coord
        facts = (group, snap, coord.error, coord.incarnation)
        wanted = self._wants.get(facts)
        if wanted is None:
            want = self.want(group, snap)
            wanted = self._wants.put(facts, (want, Ballot(group, want > group.generation)))
        return wanted

    def ballot(self) -> Ballot | None:
        """This rank's reset vote for an optimizer step's gradient all-reduce."""
        group = self._group()
        return None if group is None else self.wanted(group, self._coord.snapshot())[1]

    def new_group(self) -> None:
        """A reset began: the old group's op dies with it, never waited on in the next, and
        a vote cast in it counts for nothing."""
        self._pending.drop()
        self.vote.clear()

    def drop(self) -> None:
        """The group broke or is left: never wait on the op issued in it."""
        self._pending.drop()

    def complete_quietly(self, group: FormedGroup | None) -> None:
        """The training function returned on every rank: complete the last check's op (every
        rank issued it), so the group is never torn down under it. Its answer no longer
        matters; its failure (a peer that died since) raises for the caller to judge."""
        if group is None or not self._pending.pending:
            self._pending.drop()
            return
        with self._waiting():
            self._pending.complete(group)
