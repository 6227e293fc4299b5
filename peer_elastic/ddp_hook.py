"""A DDP communication hook that averages gradients as DDP's default does and carries the
reset vote, so a check after a DDP step needs no collective of its own.

``ddp.register_comm_hook(None, pe.allreduce_hook)``: the same arguments as torch's
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`` (the state is
the process group DDP reduces over; None: the default group), and DDP's own averaging: each
bucket is multiplied by 1 / the group's size, as DDP's reducer does (torch's Python hook
divides, which can differ in the last bit), and summed. A bucket without the vote gets the
reducer's gradients to the bit. The one that carries it is one element longer, and a backend
that cuts a buffer into chunks by its length (gloo at 4 ranks, say) may then add some
elements in another order: those can differ from the reducer's in the last bit. Every rank
gets the same sums, as from any all-reduce, so the ranks stay identical.

What it adds (:mod:`peer_elastic.torch.check.reset_vote`): while ``Peer.run`` runs the training
function, one bucket per backward pass (of each wrapper) is reduced with one more element,
this rank's ballot (1 when it wants a reset, else 0). The summed element is positive exactly when some rank
wants one, on every rank, and the next ``check_host_updates()`` takes it instead of issuing
its own all-reduce (issue 13: about 200 µs of a check at world 4 on the test machine).

Which bucket: the first one of the pass, in bucket order, whose buffer is at most
:data:`RIDER_BYTES` (DDP's first bucket is capped near 1 MiB by default). DDP reduces
buckets in index order and every rank has the same buckets, so every rank picks the same
one, and the cost is one copy of that bucket, fused with the division. When no bucket is
that small, or DDP reduces over a group that is not the whole default group (a data-parallel
dimension of a larger mesh: the others would not see the vote), no vote rides, on any rank,
and the check exchanges its own as it would without the hook.

"The first of the pass" is tracked across wrappers (a bucket with index 0 starts a pass). With
two wrappers in one backward pass that is agreed because their hooks run in the same order
on every rank: DDP drives one device per process, so autograd calls them from one thread, in
the graph's order.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] themselves, and
# refuses strings.
from typing import Any

import torch
import torch.distributed as dist

from peer_elastic.torch.check.reset_vote import Ballot, ResetVote, current_vote
from peer_elastic.torch.transport.direct_all_reduce import start_all_reduce

__all__ = ["RIDER_BYTES", "allreduce_hook"]

#: The largest bucket the vote rides on (bytes): copying it is the vote's cost.
RIDER_BYTES = 1 << 20


def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``process_group`` (None: the default group), carrying the
    reset vote on one bucket per pass (see the module's docstring)."""
    group = process_group if process_group is not None else dist.group.WORLD
    size = group.size()
    buffer = bucket.buffer()
    carried = _carrier(group, size, bucket, buffer)
    if carried is None:
        buffer.mul_(1.0 / size)
        return _reduced(start_all_reduce(buffer, group=group))
    vote, ballot = carried
    n = buffer.numel()
    flat = _rider_buffer(buffer)
    torch.mul(buffer, 1.0 / size, out=flat[:n])  # the copy and the averaging in one pass
    flat[n:].fill_(float(ballot.wants_reset))
    work = start_all_reduce(flat, group=group)

    def counted(fut: torch.futures.Future[Any]) -> torch.Tensor:
        # Before DDP sees the bucket's result, so before backward() returns: a check after
        # the step finds the vote (ResetVote.counted keeps `flat`, its last element the sum).
        fut.value()  # re-raises a failed all-reduce: the crash path, as without the hook
        vote.counted(ballot, flat)
        return flat[:n]

    return work.get_future().then(counted)


def _carrier(group: dist.ProcessGroup, size: int, bucket: dist.GradBucket,
             buffer: torch.Tensor) -> tuple[ResetVote, Ballot] | None:
    """The vote and this rank's ballot when ``bucket`` carries them, else None. Decided on
    facts every rank shares: the bucket's index and size, the group's size, and which
    buckets of this pass came before (``bucket.index()`` counts from 0 each pass)."""
    vote = current_vote()
    if vote is None or size != dist.get_world_size():
        return None
    if bucket.index() == 0:
        _pass_carried[0] = False
    if _pass_carried[0] or buffer.numel() * buffer.element_size() > RIDER_BYTES:
        return None
    # Two wrappers in one backward pass each have a rider in flight, counted in any order:
    # both carry the same ballot (see ResetVote.cast_until_taken).
    ballot = vote.cast_until_taken()
    if ballot is None:
        return None
    _pass_carried[0] = True
    return vote, ballot


# Whether a bucket of the current backward pass already carried the vote (one per pass).
_pass_carried = [False]

# The buffer each rider bucket is reduced in, one per DDP bucket (keyed by the address of DDP's
# own bucket buffer, which is the wrapper's for as long as the wrapper lives): reused, since a
# fresh one of up to 1 MiB each pass cost more than the copy into it (on CPU, fresh pages fault
# in). Reuse is safe: DDP copies the result out of it into the gradients before backward()
# returns (nothing aliases it afterwards), and the vote that keeps it is read before the next
# pass or replaced by it. Per bucket, not per size: two wrappers' riders can be in flight
# together.
_rider_buffers: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _rider_buffer(bucket_buffer: torch.Tensor) -> torch.Tensor:
    """A buffer one element longer than ``bucket_buffer``, this bucket's own."""
    numel = bucket_buffer.numel() + 1
    key = (bucket_buffer.data_ptr(), numel, bucket_buffer.dtype, bucket_buffer.device)
    flat = _rider_buffers.get(key)
    if flat is None:
        if len(_rider_buffers) >= 8:  # wrappers come and go (one per generation): stay small
            _rider_buffers.clear()
        flat = _rider_buffers[key] = torch.empty(numel, dtype=bucket_buffer.dtype,
                                                 device=bucket_buffer.device)
    return flat


def _reduced(work: dist.Work) -> torch.futures.Future[torch.Tensor]:
    return work.get_future().then(lambda fut: fut.value()[0])
