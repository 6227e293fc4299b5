"""Collectives on the default process group that the state layer is built from: transport.

Every function here is collective: every rank of the current group calls it, in the same
order. Broadcasts come from the sync source (:mod:`.sync_source`: the newest holder during
a state sync, else rank 0). Tensors travel as tensors and plain values as tagged JSON,
never pickle.

When several ranks hold the newest state (survivors of a join: the same version, hence
bit-identical) and others need it, :func:`broadcast_tensors` *stripes*: every bucket
(:mod:`.buckets`) is cut into one shard per holder, and each holder sends its shard to every
rank that needs state (point-to-point). Each byte then travels once per receiver, the
sending is spread over all holders, and no holder receives bytes it already has (a
broadcast sends them to every rank).

Beside it: :mod:`.layout_check` (every rank has the same structure before bytes are sent
into it) and ``peer_elastic.state.sync`` (a new group agrees on which state it keeps).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from peer_elastic.state.codec import decode_values, encode_values
from peer_elastic.torch.transport.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    DEFAULT_SPLIT_BYTES,
    halves,
    plan_buckets,
    shard_bounds,
)
from peer_elastic.torch.transport.snapshots import copy_all
from peer_elastic.torch.transport.sync_source import is_sync_source, sync_holders, sync_source

__all__ = [
    "DEFAULT_INLINE_BYTES",
    "SourceCannotSend",
    "all_reduce_max_inplace",
    "broadcast_bytes",
    "broadcast_inplace",
    "broadcast_payload",
    "broadcast_plain",
    "broadcast_tensors",
    "on_wire",
    "staging_device",
    "world_from_dist",
    "world_size",
]

_MAX_IN_FLIGHT = 2


def world_from_dist() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def staging_device() -> torch.device | None:
    """Device a CPU tensor must be moved to for a collective, or None if CPU works.

    A pure NCCL group cannot communicate CPU tensors; gloo (and mixed ``cpu:gloo,cuda:nccl``
    groups) can.
    """
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def broadcast_inplace(tensor: torch.Tensor) -> None:
    """Overwrite a CPU ``tensor`` with the sync source's, in place (staged for nccl)."""
    _inplace(tensor, lambda wire: dist.broadcast(wire, src=sync_source()))


def all_reduce_max_inplace(tensor: torch.Tensor) -> None:
    """Element-wise maximum of a CPU ``tensor`` over all ranks, in place (staged for nccl)."""
    _inplace(tensor, lambda wire: dist.all_reduce(wire, op=dist.ReduceOp.MAX))


def on_wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or its copy on the staging device (nccl)."""
    stage = staging_device()
    return tensor.to(stage) if stage is not None else tensor


def _inplace(tensor: torch.Tensor, collective: Callable[[torch.Tensor], Any]) -> None:
    wire = on_wire(tensor)
    collective(wire)
    if wire is not tensor:
        tensor.copy_(wire.cpu())


def world_size() -> int:
    """Size of the default group, or 1 without one."""
    return world_from_dist()[1]


def broadcast_bytes(payload: bytes) -> bytes:
    """The sync source's ``payload`` on every rank (only the source's is read): one
    broadcast when it fits in ``DEFAULT_INLINE_BYTES``, two when longer
    (:func:`broadcast_payload`)."""
    got = broadcast_payload(payload, DEFAULT_INLINE_BYTES)
    if got is None:  # pragma: no cover - only a source that passes None gets it
        raise SourceCannotSend("the sync source sent no payload")
    return got


def broadcast_plain(value: Any, what: str = "value") -> Any:
    """The sync source's (newest holder's) plain ``value`` on every rank, without pickle
    (for custom handlers).

    Every rank encodes its own value first, so an unsupported type raises TypeError on all
    ranks alike instead of leaving the others waiting in the broadcast.
    """
    payload = encode_values({"v": value}, where=what)
    if world_size() <= 1:
        return value
    return decode_values(broadcast_bytes(payload))["v"]


_LENGTH_BYTES = 8
#: The length the source puts in the header when it has no payload to send (it refused a
#: value).
_REFUSED = 2 ** (8 * _LENGTH_BYTES) - 1

DEFAULT_INLINE_BYTES = 16 * 2**10
"""Payload bytes :func:`broadcast_bytes` (and ``layout_check.broadcast_validated``) carry
in their header broadcast. An optimizer's description takes about 100-200 bytes per parameter
tensor, so a model of up to about a hundred tensors needs no second broadcast; a broadcast
of this size costs what one of 64 bytes does (gloo, loopback: 0.23 ms at world 2, 0.7 ms
at world 4)."""


class SourceCannotSend(TypeError):
    """Raised on every rank by ``layout_check.broadcast_validated`` when the sync source had no
    payload to send (it refused one of its values: its own error names the value)."""


def _header(payload: bytes | None, is_src: bool, inline: int) -> bytearray:
    """What the header broadcast carries: the source's payload length (``_REFUSED`` for
    none) and its first ``inline`` bytes. Only the source's is sent; the others receive
    into theirs."""
    header = bytearray(_LENGTH_BYTES + inline)
    if is_src:
        length = _REFUSED if payload is None else len(payload)
        header[:_LENGTH_BYTES] = length.to_bytes(_LENGTH_BYTES, "big")
        head = (payload or b"")[:inline]
        header[_LENGTH_BYTES:_LENGTH_BYTES + len(head)] = head
    return header


def broadcast_payload(payload: bytes | None, inline: int) -> bytes | None:
    """The sync source's ``payload`` on every rank (only the source's is read), or None on
    every rank when the source passed None (it could not encode its payload): one broadcast of a header (:func:`_header`; every rank must pass the same
    ``inline``), and one of the rest when the payload is longer than ``inline``."""
    is_src = is_sync_source()
    header = _header(payload, is_src, inline)
    broadcast_inplace(torch.frombuffer(header, dtype=torch.uint8))
    n = int.from_bytes(header[:_LENGTH_BYTES], "big")
    if n == _REFUSED:
        return None
    head = bytes(header[_LENGTH_BYTES:_LENGTH_BYTES + min(n, inline)])
    if n <= inline:
        return head
    if is_src:
        assert payload is not None
        rest = torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8)
    else:
        rest = torch.empty(n - inline, dtype=torch.uint8)
    broadcast_inplace(rest)
    return head + rest.numpy().tobytes()


@dataclass
class _Transfer:
    bucket: list[torch.Tensor]
    wire: torch.Tensor
    works: list[Any]
    direct: bool


@dataclass(frozen=True)
class _Route:
    """How this rank takes part in moving the buckets."""

    rank: int
    source: int  # the broadcast root when not striped
    stripes: tuple[int, ...]  # holders that each send one shard; () means broadcast
    receivers: tuple[int, ...]  # ranks that receive the shards (not holders)

    @property
    def has_data(self) -> bool:
        """Whether this rank's tensors already hold what is sent (so it packs its wires)."""
        return self.rank == self.source or self.rank in self.stripes


def _route(src: int | None) -> _Route:
    """Broadcast from ``src`` when given; else from the sync source, striped over the
    holders when :func:`syncing_from` named two or more and some rank is not one of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if src is not None:
        return _Route(rank, src, (), ())
    holders = sync_holders()
    if len(holders) < 2 or len(holders) >= world:
        return _Route(rank, sync_source(), (), ())
    receivers = tuple(r for r in range(world) if r not in holders)
    return _Route(rank, sync_source(), holders, receivers)


def _wire(bucket: list[torch.Tensor], route: _Route,
          stage: torch.device | None) -> tuple[torch.Tensor, bool]:
    """The flat tensor that travels for ``bucket`` and whether it is the tensor itself."""
    first = bucket[0]
    needs_stage = stage is not None and first.device.type == "cpu"
    if len(bucket) == 1 and first.is_contiguous() and not needs_stage:
        return first.view(-1), True  # sent and received in place, no copies
    device = stage if needs_stage else first.device
    if route.has_data:
        # torch's C++ packing (as DDP's): for 2424 state tensors 1.6 ms of overhead per half
        # bucket on top of the copy, against 5.6 ms for a Python list of reshape views.
        return _flatten_dense_tensors(bucket).to(device), False
    numel = sum(t.numel() for t in bucket)
    return torch.empty(numel, dtype=first.dtype, device=device), False


def _start_bucket(bucket: list[torch.Tensor], route: _Route, stage: torch.device | None,
                  tag: int) -> _Transfer:
    """Flatten (where the data is) and launch the bucket's transfer, asynchronously: one
    broadcast, or each holder's shard to every receiver (tagged with the bucket's number,
    so gloo never pairs one bucket's shard with another's)."""
    wire, direct = _wire(bucket, route, stage)
    if not route.stripes:
        return _Transfer(bucket, wire, [dist.broadcast(wire, src=route.source, async_op=True)],
                         direct)
    shards = shard_bounds(wire.numel(), len(route.stripes))
    ops: list[dist.P2POp] = []
    if route.rank in route.stripes:
        start, end = shards[route.stripes.index(route.rank)]
        if end > start:
            ops = [dist.P2POp(dist.isend, wire[start:end], peer, tag=tag)
                   for peer in route.receivers]
    else:
        ops = [dist.P2POp(dist.irecv, wire[start:end], peer, tag=tag)
               for peer, (start, end) in zip(route.stripes, shards, strict=True) if end > start]
    works = dist.batch_isend_irecv(ops) if ops else []
    return _Transfer(bucket, wire, works, direct)


def _finish_bucket(transfer: _Transfer, route: _Route) -> None:
    """Wait for one bucket and (on ranks that received) scatter it back into its tensors."""
    for work in transfer.works:
        work.wait()
    if route.has_data or transfer.direct:
        return
    bucket = transfer.bucket
    # Views cut and shaped in C++: for 2424 tensors 5 ms, against 14 ms for split() and a
    # view() per piece in Python.
    flat = transfer.wire.to(bucket[0].device)
    copy_all(bucket, list(_unflatten_dense_tensors(flat, bucket)))


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s (default: the sync source), in place.

    Small tensors travel packed in flat buckets, large ones in place; two buckets are in
    flight at once, so packing the next bucket overlaps the current transfer (a packed
    bucket of ``split_bytes`` or more goes as two, see :func:`halves`). A bucket is
    one ``dist.broadcast``, or, when ``src`` is not given and :func:`syncing_from` named
    several holders of the state, one shard per holder sent point-to-point to each rank that
    is not a holder. Every rank must pass tensors with the same dtypes, device kinds and
    sizes, in the same order. A no-op without a process group or with world size 1.
    """
    if world_size() <= 1:
        return
    route = _route(src)
    stage = staging_device()
    in_flight: deque[_Transfer] = deque()
    buckets = [half for bucket in plan_buckets(tensors, bucket_bytes, direct_bytes)
               for half in halves(bucket, split_bytes)]
    for tag, bucket in enumerate(buckets):
        in_flight.append(_start_bucket(bucket, route, stage, tag))
        if len(in_flight) >= _MAX_IN_FLIGHT:
            _finish_bucket(in_flight.popleft(), route)
    while in_flight:
        _finish_bucket(in_flight.popleft(), route)

