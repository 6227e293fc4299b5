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

__all__ = ["transfer"]


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def transfer(outgoing: Mapping[int, Sequence[torch.Tensor]],
             incoming: Mapping[int, Sequence[torch.Tensor]]) -> None:
    """Send ``outgoing[peer]`` to each peer and receive ``incoming[peer]`` (filled in place)
    from each: collective between every pair named, and the two sides of a pair must list
    tensors of the same sizes and dtypes in the same order."""
    ops: list[dist.P2POp] = []
    unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    keep: list[torch.Tensor] = []
    for peer in sorted(set(outgoing) | set(incoming)):
        for tag, group in enumerate(_by_dtype(outgoing.get(peer, ()))):
            if sum(t.numel() for t in group) == 0:
                continue
            flat = torch.cat([t.reshape(-1) for t in group])
            keep.append(flat)
            ops.append(dist.P2POp(dist.isend, flat, peer, tag=tag))
        for tag, group in enumerate(_by_dtype(incoming.get(peer, ()))):
            total = sum(t.numel() for t in group)
            if total == 0:
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
