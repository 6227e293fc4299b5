"""The group's exchange of paces: one all-reduce of a few integers per rank, issued at one
check and completed at the next.

About every :data:`~peer_elastic.straggler.meter.EXCHANGE_EVERY_S` (every P-th check, P
agreed by the exchange itself), each rank puts its own time and its wait per check
(:class:`~peer_elastic.straggler.meter.PaceSample`, in nanoseconds) into its own slots of
one int64 buffer, zeros elsewhere, and the group all-reduces it with MAX: every rank gets
every rank's values, the same everywhere (:class:`~peer_elastic.straggler.score.
GroupPace`). Slot 0 carries each rank's proposed period, negated, so that its MAX is the
smallest proposal: the number of checks until the next exchange, the same on every rank.

The op is issued at one check and completed at the next, as the check's own exchange is
(:mod:`peer_elastic.torch.check.pending_check`): a step runs in between, and the op has usually
completed when the next check comes, so the check does not wait on the others for it.
Measured blocking instead, on the 2-core test machine under a load of 15, a check that
exchanged waited 5-35 ms for the last rank to arrive (a wait the next gradient all-reduce
would have taken otherwise, but it showed in every check's mean). Completed a whole period
later instead, the values came a second late, and a straggler was found that much later.

Why its own collective and not a ride on the check's: with ``DistributedOptimizer`` (or
``pe.allreduce_hook``) a check runs no collective at all (the reset vote rides on the
gradient all-reduce), and a gradient bucket in bf16 would round the values.

One job: hold at most one op, of one group (compared by identity): completing it under
another group drops it unread, and a dropped op's buffer is never reused (the backend's
threads may still write into it). The caller issues and completes at the same checks on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from peer_elastic.straggler.meter import PaceSample
from peer_elastic.straggler.score import GroupPace
from peer_elastic.torch.check.max_exchange import MaxExchange

__all__ = ["PaceExchange"]

_NS = 1e9


@dataclass
class _Issued:
    group: object
    size: int
    checks: int  # the check intervals the values average over (every rank alike)
    exchange: MaxExchange
    work: dist.Work


class PaceExchange:
    """At most one op in flight; see the module docstring."""

    def __init__(self) -> None:
        self._issued: _Issued | None = None
        self._spare: MaxExchange | None = None  # the last completed op's buffer

    @property
    def pending(self) -> bool:
        return self._issued is not None

    def issue(self, group: object, rank: int, size: int, sample: PaceSample, proposal: int,
              device: torch.device) -> None:
        """Start the all-reduce of ``sample`` (this rank's, ``rank`` of ``size`` in
        ``group``, the current default process group) and of ``proposal`` (checks until
        the next exchange). Collective: every rank issues it at the same check."""
        if self._issued is not None:
            raise RuntimeError("an exchange of paces is already pending; complete or drop it")
        n = 1 + 2 * size
        buffer, self._spare = self._spare, None
        if buffer is None or buffer.tensor.numel() != n or buffer.device != device:
            buffer = MaxExchange(n, device)
        values = [0] * n
        values[0] = -max(1, proposal)
        checks = max(1, sample.checks)
        values[1 + rank] = round(sample.own_s / checks * _NS)
        values[1 + size + rank] = round(sample.waited_s / checks * _NS)
        self._issued = _Issued(group, size, sample.checks, buffer, buffer.start(values))

    def complete(self, group: object) -> tuple[GroupPace, int] | None:
        """Every rank's pace and the agreed period from the op issued in ``group``; None
        when there is none (or it was another group's: dropped unread). Waits for it (it
        completed long ago, unless a rank is far behind); raises the backend's error if a
        peer failed meanwhile (the op is gone either way)."""
        issued, self._issued = self._issued, None
        if issued is None or issued.group is not group:
            return None
        issued.work.wait()
        out = issued.exchange.read()
        self._spare = issued.exchange
        size = issued.size
        own = tuple(max(0, v) / _NS for v in out[1:1 + size])
        waited = tuple(max(0, v) / _NS for v in out[1 + size:])
        return GroupPace(own, waited, issued.checks), max(1, -out[0])

    def drop(self) -> None:
        """Forget the op without waiting (its group failed, or is being left)."""
        self._issued = None
        self._spare = None
