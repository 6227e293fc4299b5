"""Point-to-point transfer of tensor lists between ranks of the default group.

Both sides of a pair list the tensors in the same order (they come from the same plan), so
each side knows every size without asking: the sender packs its list into one flat message
per dtype, the receiver unpacks into its views. All messages of a call are posted at once
(``batch_isend_irecv``) and waited on together. Works on gloo (CPU tensors) and nccl (the
tensors' own CUDA device); nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["flat_views", "transfer"]


def flat_views(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
               device: torch.device) -> list[torch.Tensor]:
    """Empty tensors of the given shapes and dtypes, those of one dtype laid out back to
    back in one allocation, in order: :func:`transfer` receives into them with no copy."""
    totals: dict[torch.dtype, int] = {}
    for shape, dtype in shapes:
        totals[dtype] = totals.get(dtype, 0) + _numel(shape)
    flats = {dtype: torch.empty(total, dtype=dtype, device=device)
             for dtype, total in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    out = []
    for shape, dtype in shapes:
        n = _numel(shape)
        out.append(flats[dtype][offsets[dtype]:offsets[dtype] + n].view(shape))
        offsets[dtype] += n
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _one_span(group: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The flat tensor the group's tensors form when they lie back to back in one storage
    (as :func:`flat_views` makes them), else None."""
    first = group[0]
    expect = first.data_ptr()
    for t in group:
        if not t.is_contiguous() or t.data_ptr() != expect:
            return None
        expect += t.numel() * t.element_size()
    total = sum(t.numel() for t in group)
    storage = first.untyped_storage()
    if (first.storage_offset() + total) * first.element_size() > storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), (total,))


#: A tensor at least this large travels as a message of its own, sent and received where it
#: lies (no packing copy); smaller ones of one dtype are packed into one message.
DIRECT_BYTES = 1 << 20


def _messages(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The messages a list travels in, the same on both sides of a pair (they list tensors
    of the same sizes): each large tensor alone, in order, then one pack per dtype."""
    alone: list[list[torch.Tensor]] = []
    packs: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() * t.element_size() >= DIRECT_BYTES:
            alone.append([t])
        else:
            packs.setdefault(t.dtype, []).append(t)
    return alone + list(packs.values())


def transfer(outgoing: Mapping[int, Sequence[torch.Tensor]],
             incoming: Mapping[int, Sequence[torch.Tensor]]) -> None:
    """Send ``outgoing[peer]`` to each peer and receive ``incoming[peer]`` (filled in place)
    from each: collective between every pair named, and the two sides of a pair must list
    tensors of the same sizes and dtypes in the same order."""
    ops: list[dist.P2POp] = []
    unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    keep: list[torch.Tensor] = []
    for peer in sorted(set(outgoing) | set(incoming)):
        for tag, group in enumerate(_messages(outgoing.get(peer, ()))):
            if sum(t.numel() for t in group) == 0:
                continue
            if len(group) == 1:
                flat = group[0].detach().contiguous().reshape(-1)
            else:
                flat = torch.cat([t.detach().reshape(-1) for t in group])
            keep.append(flat)
            ops.append(dist.P2POp(dist.isend, flat, peer, tag=tag))
        for tag, group in enumerate(_messages(incoming.get(peer, ()))):
            total = sum(t.numel() for t in group)
            if total == 0:
                continue
            span = _one_span(group)
            if span is not None:  # received where it lies
                ops.append(dist.P2POp(dist.irecv, span, peer, tag=tag))
                continue
            flat = torch.empty(total, dtype=group[0].dtype, device=group[0].device)
            ops.append(dist.P2POp(dist.irecv, flat, peer, tag=tag))
            unpack.append((flat, group))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    with torch.no_grad():
        for flat, group in unpack:
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
