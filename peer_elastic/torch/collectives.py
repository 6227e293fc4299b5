"""Collectives on the default process group that the state layer is built from.

Every function here is collective: every rank of the current group calls it, in the same
order. Broadcasts come from the *sync source*: rank 0, unless the run loop picked the rank
holding the newest state (:func:`syncing_from`, decided by :func:`agree_and_sync`).
Tensors travel as tensors and plain values as tagged JSON, never pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from peer_elastic.agreement import Agreement, Claim, StateVersion, agree
from peer_elastic.codec import decode_values, encode_values
from peer_elastic.torch.snapshots import copy_all

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_BYTES",
    "agree_and_sync",
    "all_reduce_max_inplace",
    "broadcast_bytes",
    "broadcast_inplace",
    "broadcast_plain",
    "broadcast_tensors",
    "check_same_everywhere",
    "plan_buckets",
    "staging_device",
    "sync_source",
    "syncing_from",
    "world_from_dist",
    "world_size",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 2**20
"""Bytes per flat bucket in ``broadcast_tensors``: large enough that per-call latency is
negligible, small enough that two buckets in flight cost little memory."""

DEFAULT_DIRECT_BYTES = 4 * 2**20
"""Tensors at least this large are broadcast in place, each in its own collective: at this
size the per-call latency is already small, while flattening would cost two copies and the
page faults of a fresh staging buffer (measured: slower than the broadcast itself)."""

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


_sync_source = 0


def sync_source() -> int:
    """The rank every state broadcast comes from: 0, unless :func:`syncing_from` says else."""
    return _sync_source


@contextlib.contextmanager
def syncing_from(src: int) -> Iterator[None]:
    """Make ``sync()`` broadcast from rank ``src``: the rank :func:`agree_and_sync` found
    holding the newest state version, which need not be rank 0."""
    global _sync_source
    previous, _sync_source = _sync_source, int(src)
    try:
        yield
    finally:
        _sync_source = previous


def broadcast_inplace(tensor: torch.Tensor) -> None:
    """Overwrite a CPU ``tensor`` with the sync source's, in place (staged for nccl)."""
    _inplace(tensor, lambda wire: dist.broadcast(wire, src=_sync_source))


def all_reduce_max_inplace(tensor: torch.Tensor) -> None:
    """Element-wise maximum of a CPU ``tensor`` over all ranks, in place (staged for nccl)."""
    _inplace(tensor, lambda wire: dist.all_reduce(wire, op=dist.ReduceOp.MAX))


def _inplace(tensor: torch.Tensor, collective: Callable[[torch.Tensor], Any]) -> None:
    stage = staging_device()
    wire = tensor.to(stage) if stage is not None else tensor
    collective(wire)
    if wire is not tensor:
        tensor.copy_(wire.cpu())


def world_size() -> int:
    """Size of the default group, or 1 without one."""
    return world_from_dist()[1]


def broadcast_bytes(payload: bytes) -> bytes:
    """The sync source's ``payload`` on every rank: length, then the bytes (two broadcasts)."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_inplace(length)
    n = int(length.item())
    if n == 0:
        return b""
    if dist.get_rank() == sync_source():
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    broadcast_inplace(buf)
    return buf.numpy().tobytes()


def broadcast_plain(value: Any, what: str = "value") -> Any:
    """Rank 0's plain ``value`` on every rank, without pickle (for custom handlers).

    Every rank encodes its own value first, so an unsupported type raises TypeError on all
    ranks alike instead of leaving the others waiting in the broadcast.
    """
    payload = encode_values({"v": value}, where=what)
    if world_size() <= 1:
        return value
    return decode_values(broadcast_bytes(payload))["v"]


def check_same_everywhere(description: str, what: str) -> None:
    """Raise ValueError on EVERY rank unless all ranks have the same ``description``.

    A mismatched structure would otherwise make the bucketed broadcasts disagree on sizes
    and hang or corrupt memory; comparing a digest costs two tiny collectives.
    """
    digest = hashlib.sha256(description.encode("utf-8")).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    root = mine.clone()
    broadcast_inplace(root)
    differs_here = not torch.equal(root, mine)
    flag = torch.tensor([int(differs_here)], dtype=torch.uint8)
    all_reduce_max_inplace(flag)
    if flag.item():
        where = "this rank differs from rank 0" if differs_here else "another rank differs"
        raise ValueError(
            f"{what} differs between ranks ({where}); every peer must build the same models, "
            f"optimizers and state attributes. This rank's layout begins: {description[:300]!r}"
        )


@dataclass
class _Transfer:
    bucket: list[torch.Tensor]
    wire: torch.Tensor
    work: Any
    direct: bool


def plan_buckets(
    tensors: Sequence[torch.Tensor], cap: int, direct: int
) -> list[list[torch.Tensor]]:
    """Group by (dtype, device) in first-seen order; tensors of ``direct`` bytes or more get
    a bucket of their own, the others are packed into buckets of at most ``cap`` bytes.

    Depends only on sizes, dtypes and devices (never on memory layout), so every rank plans
    the same buckets.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in groups.values():
        current: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if nbytes >= direct:
                buckets.append([t])
                continue
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(t)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def _start_bucket(
    bucket: list[torch.Tensor], is_src: bool, src: int, stage: torch.device | None
) -> _Transfer:
    """Flatten (on the source) and launch an async broadcast of one bucket."""
    first = bucket[0]
    needs_stage = stage is not None and first.device.type == "cpu"
    if len(bucket) == 1 and first.is_contiguous() and not needs_stage:
        wire, direct = first, True  # broadcast in place, no copies
    else:
        device = stage if needs_stage else first.device
        if is_src:
            wire = torch.cat([t.reshape(-1) for t in bucket]).to(device)
        else:
            wire = torch.empty(sum(t.numel() for t in bucket), dtype=first.dtype, device=device)
        direct = False
    work = dist.broadcast(wire, src=src, async_op=True)
    return _Transfer(bucket, wire, work, direct)


def _finish_bucket(transfer: _Transfer, is_src: bool) -> None:
    """Wait for one bucket and (on receivers) scatter it back into its tensors."""
    transfer.work.wait()
    if is_src or transfer.direct:
        return
    bucket = transfer.bucket
    flat = transfer.wire.to(bucket[0].device)
    pieces = flat.split([t.numel() for t in bucket])
    copy_all(bucket, [p.view(t.shape) for p, t in zip(pieces, bucket, strict=True)])


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s (default: the sync source), in place.

    Small tensors travel packed in flat buckets (one ``dist.broadcast`` per bucket), large
    ones in place; two collectives are in flight at once, so packing the next bucket overlaps
    the current broadcast. Every rank must pass tensors with the same dtypes, device kinds and
    sizes, in the same order. A no-op without a process group or with world size 1.
    """
    if world_size() <= 1:
        return
    src = sync_source() if src is None else src
    is_src = dist.get_rank() == src
    stage = staging_device()
    in_flight: deque[_Transfer] = deque()
    for bucket in plan_buckets(tensors, bucket_bytes, direct_bytes):
        in_flight.append(_start_bucket(bucket, is_src, src, stage))
        if len(in_flight) >= _MAX_IN_FLIGHT:
            _finish_bucket(in_flight.popleft(), is_src)
    while in_flight:
        _finish_bucket(in_flight.popleft(), is_src)


def agree_and_sync(state: Any, claim: Claim, device: torch.device,
                   resume: Callable[[], Agreement | None] | None = None) -> Agreement:
    """Agree on the newest state version, then sync from a rank holding it if needed.

    Collective over the default group. One all-gather of every rank's :class:`Claim` (four
    integers each); every rank applies :func:`peer_elastic.agreement.agree` to the same list,
    so all sync from the same source, or all skip the sync when every rank already holds the
    same version and nobody asked for state. The state everybody ends with is saved as the
    new restore point: a failure before the next commit must not roll a rank back to what it
    held before.

    ``resume`` (durable snapshots) is called on every rank when no rank holds committed
    state (every claim at the initial version): it is collective, and returns the agreement
    to sync by when some rank loaded a snapshot into its live state, else None.
    """
    mine = torch.tensor(claim.as_ints(), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    claims = [Claim.from_ints(t.tolist()) for t in gathered]
    resumed = None
    if resume is not None and all(c.version == StateVersion() for c in claims):
        resumed = resume()  # every rank decides the same: the claims are the same list
    agreement = resumed or agree(claims)
    if agreement.source is None:
        return agreement
    if len({c.version for c in claims}) > 1:
        log.info("state versions differ (%s): adopting %s from rank %d",
                 ", ".join(str(c.version.as_ints()) for c in claims),
                 agreement.version.as_ints(), agreement.source)
    with syncing_from(agreement.source):
        state.sync()
    if hasattr(state, "commit_count"):
        state.commit_count = agreement.version.commits
    state.save()
    return agreement
