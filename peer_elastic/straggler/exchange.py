"""The group's exchange of paces: one blocking all-reduce of a few integers per rank.

Every :data:`~peer_elastic.straggler.meter.EXCHANGE_EVERY_S` or so (every P-th check, P
agreed by the exchange itself), each rank puts its own time and its wait per check
(:class:`~peer_elastic.straggler.meter.PaceSample`, in nanoseconds) into its own slots of
one int64 buffer, zeros elsewhere, and the group all-reduces it with MAX: every rank gets
every rank's values, the same everywhere (:class:`~peer_elastic.straggler.score.
GroupPace`). Slot 0 carries each rank's proposed period, negated, so that its MAX is the
smallest proposal: the number of checks until the next exchange, the same on every rank.

Why its own collective and not a ride on the check's exchange: with
``DistributedOptimizer`` (or ``pe.allreduce_hook``) a check runs no collective at all (the
reset vote rides on the gradient all-reduce), and a gradient bucket in bf16 would round the
values. Once a second, a blocking all-reduce of ``1 + 2 x world`` integers costs what a
check's own exchange costs (about 0.2 ms on the 2-core test machine at world 4), a few
hundredths of a percent of the time: ``benchmarks/bench_straggler.py`` measures it.

One job: fill, run and read the buffer (:class:`~peer_elastic.torch.check.max_exchange.
MaxExchange`). The caller runs it at the same check on every rank.
"""

from __future__ import annotations

import torch

from peer_elastic.straggler.meter import PaceSample
from peer_elastic.straggler.score import GroupPace
from peer_elastic.torch.check.max_exchange import MaxExchange

__all__ = ["PaceExchange"]

_NS = 1e9


class PaceExchange:
    """Holds the buffer of one group size and device, reused from exchange to exchange."""

    def __init__(self) -> None:
        self._buffer: MaxExchange | None = None

    def run(self, rank: int, size: int, sample: PaceSample, proposal: int,
            device: torch.device) -> tuple[GroupPace, int]:
        """Exchange ``sample`` (this rank's, ``rank`` of ``size``) and ``proposal`` (checks
        until the next exchange); returns every rank's pace and the agreed period.
        Collective and blocking: every rank of the default group calls it at the same
        check."""
        n = 1 + 2 * size
        buffer = self._buffer
        if buffer is None or buffer.tensor.numel() != n or buffer.device != device:
            buffer = self._buffer = MaxExchange(n, device)
        values = [0] * n
        values[0] = -max(1, proposal)
        checks = max(1, sample.checks)
        values[1 + rank] = round(sample.own_s / checks * _NS)
        values[1 + size + rank] = round(sample.waited_s / checks * _NS)
        out = buffer.run(values)
        own = tuple(max(0, v) / _NS for v in out[1:1 + size])
        waited = tuple(max(0, v) / _NS for v in out[1 + size:])
        return GroupPace(own, waited, sample.checks), max(1, -out[0])
