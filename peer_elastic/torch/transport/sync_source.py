"""The sync source: the rank every state broadcast comes from, and the ranks that hold the
same state.

Outside a state sync it is rank 0. When a new group agrees on its state
(:func:`peer_elastic.state.sync.agree_and_sync`, or a sharded state's regroup), it is the
newest holder: the lowest rank holding the newest state version, set for the duration of
the sync by :func:`syncing_from`. Every broadcast of :mod:`.collectives` sends from it, and
a custom handler that broadcasts by itself must too (``peer_elastic.state.sync_source``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["is_sync_source", "sync_holders", "sync_source", "syncing_from"]


@dataclass(frozen=True)
class _SyncFrom:
    """Where a state sync comes from (set by :func:`syncing_from`)."""

    source: int = 0  # sends plain values, and every tensor unless striped
    holders: tuple[int, ...] = ()  # ranks holding the source's state bit for bit (it included)


_sync_from = _SyncFrom()


def sync_source() -> int:
    """The rank every state broadcast comes from: the newest holder during a sync
    (:func:`syncing_from`), else 0."""
    return _sync_from.source


def is_sync_source() -> bool:
    """Whether this rank is the one every state broadcast comes from."""
    return dist.get_rank() == _sync_from.source


def sync_holders() -> tuple[int, ...]:
    """The ranks that already hold the sync source's state (sorted, the source included),
    or () when only the source is known to (see :func:`syncing_from`)."""
    return _sync_from.holders


@contextlib.contextmanager
def syncing_from(src: int, holders: Sequence[int] = ()) -> Iterator[None]:
    """Make ``sync()`` broadcast from rank ``src``: the rank the group's agreement found
    holding the newest state version, which need not be rank 0.

    ``holders``: every rank known to hold exactly ``src``'s state (``src`` among them; the
    same state version is the same state). With two or more, and some rank outside them,
    :func:`~.collectives.broadcast_tensors` stripes the bytes over the holders instead of
    broadcasting. Every rank must pass the same values.
    """
    global _sync_from
    holders = tuple(sorted({int(h) for h in holders}))
    if holders and int(src) not in holders:
        raise ValueError(f"sync source {src} is not among the holders {holders}")
    previous, _sync_from = _sync_from, _SyncFrom(int(src), holders)
    try:
        yield
    finally:
        _sync_from = previous

