"""Kept copies of tensors: what a commit saves into and a restore copies back from.

A commit runs every few batches, so it copies into buffers allocated once (``copy_``
afterwards) instead of ``deepcopy`` or pickle per commit.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

__all__ = ["Buffers", "copy_all", "same_meta"]


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one dispatch when torch has ``_foreach_copy_``."""
    if not dsts:
        return
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(list(dsts), list(srcs))
        else:  # pragma: no cover - older torch
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)


def same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class Buffers:
    """Kept copies of keyed tensors: allocated once, then refilled with ``copy_``.

    A buffer is reallocated only when its tensor's shape, dtype or device changed, and
    dropped when its key is no longer captured, so memory stays one copy of the state.
    """

    def __init__(self) -> None:
        self._store: dict[Hashable, torch.Tensor] = {}

    def capture(self, items: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        store: dict[Hashable, torch.Tensor] = {}
        dsts, srcs = [], []
        for key, tensor in items:
            live = tensor.detach()
            buf = self._store.get(key)
            if buf is None or not same_meta(buf, live):
                buf = torch.empty(live.shape, dtype=live.dtype, device=live.device)
            store[key] = buf
            dsts.append(buf)
            srcs.append(live)
        self._store = store
        copy_all(dsts, srcs)

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        return self._store[key]

    def data_ptrs(self) -> list[int]:
        """Addresses of the buffers (lets tests check that commits do not reallocate)."""
        return [t.data_ptr() for t in self._store.values()]
