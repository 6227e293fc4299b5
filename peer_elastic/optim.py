"""Gradient averaging that survives resets.

``DistributedOptimizer(opt)`` makes ``opt.step()`` first average every gradient over the
*current* default process group (whatever generation is formed now) in large flat buckets,
then take the wrapped optimizer's step. Because it looks up the group at each step, nothing
needs rebuilding after a reset, unlike DDP (see the README for rebuilding DDP in a reset
callback).

After the averaging, each gradient is a view of the flat buffer its bucket was reduced in
(as with DDP's ``gradient_as_bucket_view``), not a copy: one pass over the gradient bytes
fewer per step. In-place work on ``p.grad`` afterwards (clipping, accumulation with
``zero_grad(set_to_none=False)``) works as on any gradient.

The optimizer object keeps its identity and class hierarchy (its class is swapped for a
subclass), so ``isinstance(opt, torch.optim.Adam)`` and :class:`~peer_elastic.TorchState`
keep working, and its ``state_dict()`` is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from peer_elastic.straggler import waits
from peer_elastic.torch.check.reset_vote import current_vote
from peer_elastic.torch.transport.buckets import plan_buckets
from peer_elastic.torch.transport.direct_all_reduce import all_reduce_now

DEFAULT_BUCKET_BYTES = 32 << 20

_DIST = dist.is_available()


_BALLOT_ELEMENTS: dict[tuple[bool, torch.dtype, torch.device], torch.Tensor] = {}


def _ballot_element(wants_reset: bool, like: torch.Tensor) -> torch.Tensor:
    """The one-element tensor a rank appends to the voting bucket: 1 for a reset, else 0.
    Made once per dtype and device (``torch.cat`` copies it; nothing writes to it): a fresh
    one every step cost more than the rest of the vote (measured with the caches cold)."""
    key = (wants_reset, like.dtype, like.device)
    element = _BALLOT_ELEMENTS.get(key)
    if element is None:
        element = _BALLOT_ELEMENTS[key] = torch.full((1,), float(wants_reset),
                                                     dtype=like.dtype, device=like.device)
    return element


class _Averaging:
    """Mixin placed in front of the user's optimizer class."""

    _pe_bucket_bytes: int

    def synchronize(self) -> None:
        """All-reduce and average gradients now (``step()`` does this itself).

        Afterwards each averaged gradient (``p.grad``) is a view of the flat buffer its
        bucket was reduced in, as with DDP's ``gradient_as_bucket_view``: copying the
        averages back into the old gradient tensors would cost a pass over every gradient
        byte per step. A parameter whose gradient was not contiguous keeps its gradient
        tensor (its layout) and gets the average copied in.
        """
        # dist.group.WORLD: the default group, None when there is none. Cheaper than
        # is_initialized() + get_world_size(), which matters on the per-step hot path.
        pg = dist.group.WORLD if _DIST else None
        if pg is None:
            return
        world = pg.size()
        if world == 1:
            return
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]  # type: ignore[attr-defined]
        for p in params:
            if p.grad is None:
                # Every rank must reduce the same tensors; a rank that produced no gradient
                # for a parameter contributes zeros.
                p.grad = torch.zeros_like(p)
        # The same bucket plan state sync uses: by dtype and device, in parameter order, so
        # every rank reduces the same buckets (a gradient has its parameter's size, dtype
        # and device, so planning on the parameters plans the same buckets).
        buckets = plan_buckets(params, self._pe_bucket_bytes, self._pe_bucket_bytes)
        # The run loop's reset vote rides on the last bucket of several gradients (always
        # flattened, on every rank alike), so a check after this step needs no collective
        # of its own (peer_elastic.torch.check.reset_vote).
        vote = current_vote()
        ballot = vote.cast() if vote is not None else None
        rider = len(buckets) - 1  # the last bucket of several gradients, if any
        while rider >= 0 and len(buckets[rider]) < 2:
            rider -= 1
        # The all-reduces are where this rank waits on slower ones: timed, for the
        # straggler score (peer_elastic.straggler.waits).
        tally = waits.tally()
        for i, bucket in enumerate(buckets):
            grads = [p.grad for p in bucket]
            if len(grads) == 1 and grads[0].is_contiguous():
                tally.enter_wait()
                try:
                    all_reduce_now(grads[0])  # large: in place (SUM)
                finally:
                    tally.leave_wait()
                grads[0].div_(world)
                continue
            riding = ballot is not None and i == rider
            if riding:
                flat = _flatten_dense_tensors([*grads, _ballot_element(ballot.wants_reset,
                                                                        grads[0])])
            else:
                flat = _flatten_dense_tensors(grads)
            tally.enter_wait()
            try:
                all_reduce_now(flat)  # SUM; dist.all_reduce's wrapper costs on the hot path
            finally:
                tally.leave_wait()
            flat.div_(world)  # the ballot element too: still positive exactly when one voted 1
            if riding:
                # The bucket itself, its last element the vote: it stays alive until the
                # check takes it or the next step replaces it (no slice or copy per step).
                vote.counted(ballot, flat)
            # The trailing ballot element, if any, is past the last gradient: not unflattened.
            for p, grad, avg in zip(bucket, grads, _unflatten_dense_tensors(flat, grads),
                                    strict=True):
                if grad.is_contiguous():
                    p.grad = avg
                else:
                    grad.copy_(avg)

    def step(self, closure: Any = None) -> Any:
        self.synchronize()
        return super().step(closure)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def DistributedOptimizer(  # noqa: N802 - named like Horovod's, which users port from
    optimizer: torch.optim.Optimizer, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients over the current group before each step."""
    base = type(optimizer)
    if isinstance(optimizer, _Averaging):
        return optimizer
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Averaging{base.__name__}", (_Averaging, base), {})
    optimizer.__class__ = cls
    optimizer._pe_bucket_bytes = bucket_bytes  # type: ignore[attr-defined]
    return optimizer
