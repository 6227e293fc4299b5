"""A new group takes over sharded state: agree where it lives, then reshard it in memory.

Collective over the new default group, called by the run loop instead of the replicated
state's agree-and-sync:

1. One all-gather of every rank's :class:`~peer_elastic.state.agreement.Claim` and
   :class:`~peer_elastic.sharded.plan.Holding` (a few dozen integers each).
2. Every rank applies :func:`~peer_elastic.sharded.plan.choose_restore` to the same list: the
   newest version whose every shard some rank still holds. The ranks holding it count as
   trained for :func:`~peer_elastic.state.agreement.should_resume`, the others not, so a group that
   lost more shards than the redundancy covers loads the newest durable snapshot, exactly as
   a replicated group that lost every holder.
3. In memory: the sync source (the lowest rank holding the version) sends the catalog (names,
   shapes, hyperparameters); every rank builds a fresh module on the new mesh; each needed
   row range travels once, from a holder to its new owner (:func:`~peer_elastic.sharded.plan.plan_moves`);
   replicated tensors and the other state (sampler, plain values) come from the source.
4. The result is saved (own shard plus copies in the new layout) before training goes on.

A group that holds shards of trained state but not all of any version, and has no snapshot
to load, stops with :class:`~peer_elastic.errors.ShardedStateLost`: never a silent restart
from the initial weights, never a model assembled from two versions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from peer_elastic.errors import ShardedStateLost
from peer_elastic.sharded.catalog import Catalog
from peer_elastic.sharded.exchange import flat_views, transfer
from peer_elastic.sharded.plan import (
    MAX_HELD,
    Holding,
    Layout,
    RestorePoint,
    choose_restore,
    newest_held,
    plan_moves,
    rows,
    wanted_shards,
)
from peer_elastic.sharded.state import Arrived, ShardedState
from peer_elastic.state.agreement import Agreement, Claim, StateVersion, new_lineage, should_resume
from peer_elastic.state.codec import decode_values, encode_values
from peer_elastic.torch.transport.collectives import broadcast_bytes, broadcast_tensors
from peer_elastic.torch.transport.sync_source import syncing_from

__all__ = ["regroup"]

log = logging.getLogger(__name__)

Resume = Callable[[Sequence[Claim]], "Agreement | None"]


SLOTS = 2  # holdings one rank reports: its confirmed save and an unconfirmed newer one
_SLOT_INTS = 8 + MAX_HELD


def _encode(holdings: Sequence[Holding], values: StateVersion | None) -> list[int]:
    ints = list(values.as_ints()) if values is not None else [-1, -1, -1, -1]
    for i in range(SLOTS):
        holding = holdings[i] if i < len(holdings) else Holding(StateVersion(), None, ())
        layout = holding.layout
        ints += [*holding.version.as_ints(),
                 *((layout.generation, layout.world, layout.shards) if layout else (-1, -1, -1)),
                 len(holding.shards), *holding.shards,
                 *([-1] * (MAX_HELD - len(holding.shards)))]
    return ints


def _decode(ints: Sequence[int]) -> tuple[tuple[Holding, ...], StateVersion | None]:
    values = None if list(ints[:4]) == [-1, -1, -1, -1] else StateVersion.from_ints(ints[:4])
    out = []
    for i in range(SLOTS):
        slot = ints[4 + i * _SLOT_INTS:4 + (i + 1) * _SLOT_INTS]
        version = StateVersion.from_ints(slot[:4])
        gen, world, shards, count = slot[4:8]
        if world < 0:
            continue
        if not 0 <= count <= MAX_HELD or world < 1 or shards < 1 or world % shards:
            raise ValueError(f"malformed shard holding {tuple(slot)}")
        out.append(Holding(version, Layout(gen, world, shards), tuple(slot[8:8 + count])))
    return tuple(out), values


def regroup(state: ShardedState, claim: Claim, device: torch.device, generation: int,
            resume: Resume | None = None) -> tuple[Agreement, bool]:
    """Give every rank of the new group its shard of the newest complete state.

    Returns the agreement (its source: the rank the other state came from) and whether the
    group looked for a durable snapshot (nobody held a complete trained version, or one
    newer than it was seen): what the run loop's report of lost state needs.
    """
    mine = torch.tensor([*claim.as_ints(), *_encode(state.holdings(), state.values_version)],
                        dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows_ints = [t.cpu().tolist() for t in gathered]
    claims = [Claim.from_ints(r[:Claim.INTS]) for r in rows_ints]
    decoded = [_decode(r[Claim.INTS:]) for r in rows_ints]
    holdings = [held for held, _ in decoded]
    point = choose_restore(holdings, [values for _, values in decoded])
    held_by = set(point.holders()) if point is not None else set()
    # Only ranks holding a complete version count as trained: a shard alone is not state.
    effective = [Claim(point.version if point is not None and r in held_by else StateVersion(),
                       c.needs_state, c.snapshot, c.proposal) for r, c in enumerate(claims)]
    layout = state.new_layout(generation)
    tried = should_resume(effective)
    if resume is not None and tried:
        resumed = resume(effective)
        if resumed is not None:
            _finish(state, resumed.source or 0, resumed.version)
            return Agreement(resumed.source or 0, resumed.version), True
    if point is None:
        lost = newest_held(holdings)
        if lost is not None:
            disk = ("no durable snapshot could be loaded (none written yet, or none "
                    "readable)" if resume is not None else
                    "the job has no snapshot_dir: set one to resume from disk in that case")
            raise ShardedStateLost(
                f"sharded state lost: no rank of this group holds every shard of any trained "
                f"version (the newest held is {lost.commits} commits; held: "
                f"{_describe(holdings)}). More peers died at once than "
                f"redundancy={state.redundancy} covers, and {disk}")
        state.build_initial(layout, device)
        version = StateVersion(lineage=new_lineage(claims))
        _finish(state, 0, version)
        return Agreement(0, version), tried
    arrived = _reshard(state, point, layout, device, point.holders()[0])
    _finish(state, point.values_from, point.version, arrived)
    return Agreement(point.values_from, point.version), tried


def _describe(holdings: Sequence[Sequence[Holding]]) -> str:
    parts = []
    for rank, held in enumerate(holdings):
        for h in held:
            if h.layout is not None:
                parts.append(f"rank {rank}: shards {list(h.shards)} of {h.layout.shards} at "
                             f"{h.version.commits} commits (generation {h.layout.generation})")
    return "; ".join(parts) or "nothing"


def _reshard(state: ShardedState, point: RestorePoint, layout: Layout, device: torch.device,
             source: int) -> Arrived:
    """Build the module on the new mesh filled with this rank's rows of ``point``; returns
    them, with the copies of other shards this rank keeps in the new layout (moved along)."""
    rank = dist.get_rank()
    saved = state.saved(point.version, point.layout)
    with syncing_from(source):
        if rank == source:
            assert saved is not None
            payload = encode_values(saved.catalog.describe(), where="ShardedState catalog")
        else:
            payload = b""
        catalog = Catalog.parse(decode_values(broadcast_bytes(payload)))
    if saved is not None:
        if saved.catalog.layout() != catalog.layout():
            raise ValueError("this rank's saved shards differ in layout from the sync "
                             "source's catalog")
        held = saved.rows_by_shard()
    else:
        held = {}
    # This rank's new shard, and the copies it keeps of others in the new layout: all come
    # in one transfer (the old holders send the copies too), not a second one after it.
    wanted = wanted_shards(layout, state.redundancy)
    targets: dict[int, list[torch.Tensor]] = {}
    for who, shard in wanted:
        if who == rank:
            shapes = []
            for entry in catalog.sharded:
                lo, hi = rows(entry.rows, layout.shards, shard)
                shapes.append(((hi - lo, *entry.row_shape), entry.torch_dtype))
            targets[shard] = flat_views(shapes, device)
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[torch.Tensor]] = {}
    for move in plan_moves([e.rows for e in catalog.sharded], point, layout, wanted):
        if move.sender == rank:
            src = held[move.shard][move.tensor][move.src_rows[0]:move.src_rows[1]]
            if move.receiver == rank:
                targets[move.target][move.tensor][move.dst_rows[0]:move.dst_rows[1]].copy_(src)
            else:
                outgoing.setdefault(move.receiver, []).append(src)
        elif move.receiver == rank:
            incoming.setdefault(move.sender, []).append(
                targets[move.target][move.tensor][move.dst_rows[0]:move.dst_rows[1]])
    transfer(outgoing, incoming)
    new_rows = targets.pop(layout.shard_of(rank))
    if rank == source:
        assert saved is not None and saved.replicated is not None
        replicated = [t.clone() for t in saved.replicated]
    else:
        replicated = [torch.empty(e.shape, dtype=e.torch_dtype, device=device)
                      for e in catalog.replicated]
    with syncing_from(source):
        broadcast_tensors(replicated)
    state.rebuild(layout, device, catalog, new_rows, replicated)
    moved = sum(t.numel() * t.element_size() for ts in incoming.values() for t in ts)
    log.info("resharded %d tensors from %d x %d to %d x %d shards at %d commits "
             "(%d bytes received, copies included)", len(catalog.sharded),
             point.layout.replicas, point.layout.shards, layout.replicas, layout.shards,
             point.version.commits, moved)
    # the rows just installed are the live state: its first save keeps them as they are
    return Arrived(new_rows, replicated, targets)


def _finish(state: ShardedState, source: int, version: StateVersion,
            arrived: Arrived | None = None) -> None:
    """The rest of the state from the source, then save the agreed version everywhere
    (``arrived``: what the reshard left for that save)."""
    with syncing_from(source):
        state.sync()
    state.commit_count = version.commits
    state.expect_save(version)
    if arrived is None:
        state.save()
    else:
        state.save_arrived(version, arrived)
