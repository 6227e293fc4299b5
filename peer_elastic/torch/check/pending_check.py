"""The per-step generation exchange, issued at one check and completed at the next.

``check_host_updates()`` must make every rank of a group raise at the same call. A blocking
all-reduce (MAX) of "the newest generation I know of" does that, but it costs a round trip
per check, nearly all of the check. :class:`PendingCheck` issues that all-reduce
asynchronously at check *k* and completes it at check *k + 1*: every rank makes the same
sequence of check calls (the contract), so every rank completes the same op at the same call
and gets the same answer there. All ranks still raise together, one check later than with a
blocking exchange.

One job: hold at most one op, of one group. The op belongs to the group it was issued in;
completing it under another group (after a reset) drops it unread instead, so a destroyed
group's op is never waited on in the next group. The buffer lives on the device the caller
names (CPU for gloo, CUDA for nccl) and is filled, issued and read by
:class:`~peer_elastic.torch.check.max_exchange.MaxExchange` (cheaply: the issue is on the
training step's critical path). The op also agrees on how many checks pass until the next
one (:mod:`peer_elastic.torch.check.check_cadence`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from peer_elastic.torch.check.max_exchange import MaxExchange

__all__ = ["PendingCheck", "PendingResult"]


@dataclass(frozen=True)
class PendingResult:
    """What every rank of the group reported at the check that issued the op."""

    newest_generation: int  # the MAX over ranks of the newest generation each knew of
    period: int = 1  # the MIN over ranks of the check period each proposed (check_cadence)


@dataclass
class _Issued:
    group: object  # the FormedGroup it was issued in (compared by identity)
    exchange: MaxExchange
    work: dist.Work


class PendingCheck:
    """At most one in-flight all-reduce (MAX) of a generation number and of a proposed check
    period, negated (so that the MAX of the negations is the smallest proposal)."""

    def __init__(self) -> None:
        self._issued: _Issued | None = None
        # The buffer of the last op that completed, reused by the next (no allocation per
        # check). Never a dropped op's: the backend's threads may still write into that one.
        self._spare: MaxExchange | None = None

    @property
    def pending(self) -> bool:
        return self._issued is not None

    def issue(self, group: object, want: int, device: torch.device, period: int = 1) -> None:
        """Start the exchange of ``want`` and of the proposed ``period`` in ``group`` (the
        current default process group)."""
        if self._issued is not None:
            raise RuntimeError("an exchange is already pending; complete or drop it first")
        if period < 1:
            raise ValueError(f"a check period is at least 1, not {period}")
        exchange, self._spare = self._spare, None
        if exchange is None or exchange.device != device:
            exchange = MaxExchange(2, device)
        work = exchange.start((want, -period))
        self._issued = _Issued(group, exchange, work)

    def complete(self, group: object) -> PendingResult | None:
        """Wait for the op issued in ``group`` and return its result; None if there is none.

        Blocks on the other ranks (callers wrap it in a liveness ``collective()``); raises the
        backend's error if a peer failed meanwhile (the op is dropped either way). An op of
        another group is dropped unread.
        """
        issued, self._issued = self._issued, None
        if issued is None or issued.group is not group:
            return None
        issued.work.wait()
        newest, negated_period = issued.exchange.read()
        result = PendingResult(newest_generation=int(newest), period=-int(negated_period))
        self._spare = issued.exchange
        return result

    def drop(self) -> None:
        """Forget the op without waiting (its group failed or is being destroyed)."""
        self._issued = None
        self._spare = None
