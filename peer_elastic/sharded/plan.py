"""Where sharded state lives and how it moves: the pure planner (no torch, no etcd).

FSDP2 shards every tensor on dim 0 by the ``torch.chunk`` rule: with ``n`` rows over ``S``
shards, shard ``s`` holds rows ``[min(s*c, n), min((s+1)*c, n))`` with ``c = ceil(n / S)``.
Under HSDP the ranks form a ``(replicas, shards)`` mesh, row-major, so rank ``r`` holds shard
``r % shards`` and the replicas of one shard hold the same rows.

Three decisions, each a function of facts every rank has (so every rank computes the same
answer with no further talk):

* :func:`copy_holders`: at a commit, which *other* ranks keep a copy of each shard, so that
  ``redundancy`` ranks may die at once without losing a shard. Copies are spread around the
  ring (rank ``s + W/(k+1)``, ...), never on a leaving rank, and replicas count as copies.
* :func:`choose_restore`: after a failure, the newest (version, layout) whose every shard some
  rank of the new group still holds. Shards of different versions are never mixed.
* :func:`plan_moves`: which rows each new rank needs from which holder, per tensor. A holder
  that is also the new owner copies locally; other rows travel point-to-point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from peer_elastic.state.agreement import StateVersion

__all__ = [
    "MAX_HELD",
    "Holding",
    "Layout",
    "Move",
    "RestorePoint",
    "choose_restore",
    "copy_holders",
    "mesh_shape",
    "newest_held",
    "plan_moves",
    "rows",
    "senders_by_pair",
    "wanted_shards",
]


#: The most shard indices one rank reports holding (its own and its copies) when a group forms.
MAX_HELD = 32


def rows(n: int, shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of dim 0 that shard ``shard`` of ``shards`` holds (may be empty)."""
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}")
    chunk = -(-n // shards)
    return min(shard * chunk, n), min((shard + 1) * chunk, n)


def mesh_shape(world: int, shard_degree: int | None) -> tuple[int, int]:
    """``(replicas, shards)`` of the mesh a group of ``world`` ranks uses.

    ``None``: plain FSDP, one replica sharded over every rank. Otherwise HSDP with shard
    groups of the smallest divisor of ``world`` that is at least ``shard_degree`` (``world``
    itself when none is): a world size that does not factor shards finer, never coarser, so
    no rank ever holds a larger shard than the degree asked for (5 ranks at degree 2 run as
    one group of 5; 6 as three replicas of 2).
    """
    if world < 1:
        raise ValueError(f"world size {world}")
    if shard_degree is None:
        return 1, world
    if shard_degree < 1:
        raise ValueError(f"shard_degree must be at least 1, not {shard_degree}")
    shards = next((d for d in range(min(shard_degree, world), world + 1) if world % d == 0), world)
    return world // shards, shards


@dataclass(frozen=True, order=True)
class Layout:
    """How one group sharded the state: its generation, size and shard degree."""

    generation: int
    world: int
    shards: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.shards < 1 or self.world % self.shards:
            raise ValueError(f"invalid layout {self}")

    @property
    def replicas(self) -> int:
        return self.world // self.shards

    def shard_of(self, rank: int) -> int:
        """The shard coordinate of ``rank`` (row-major ``(replicas, shards)`` mesh)."""
        return rank % self.shards

    def ranks_of(self, shard: int) -> tuple[int, ...]:
        """The ranks whose own shard is ``shard`` (its replicas)."""
        return tuple(shard + rep * self.shards for rep in range(self.replicas))


def copy_holders(layout: Layout, redundancy: int,
                 leaving: Iterable[int] = ()) -> dict[int, tuple[int, ...]]:
    """For each shard, the ranks that receive a copy of it at a save (its replicas excluded).

    Each shard ends up on at least ``redundancy + 1`` ranks that are not leaving, counting its
    replicas that stay, when the group has that many staying ranks. Copies go to ranks spread
    around the ring from the shard's first replica: with FSDP every rank then holds exactly
    ``redundancy`` copies (none of them a neighbour's when ``redundancy`` is 1: the two
    youngest ranks, which leave first when the job shrinks, never hold each other's only copy).
    The copies of a leaving rank's shard go to staying ranks.
    """
    if redundancy < 0:
        raise ValueError(f"redundancy must be at least 0, not {redundancy}")
    gone = set(leaving)
    world = layout.world
    out: dict[int, tuple[int, ...]] = {}
    for shard in range(layout.shards):
        owners = set(layout.ranks_of(shard))
        staying_owners = len(owners - gone)
        wanted = max(0, redundancy + 1 - staying_owners)
        candidates = [r for r in range(world) if r not in owners and r not in gone]
        chosen: list[int] = []
        for j in range(1, wanted + 1):
            if not candidates:
                break
            target = (shard + (j * world + wanted) // (wanted + 1)) % world
            # the first free candidate at or after the target position on the ring
            pick = min(candidates, key=lambda r, t=target: (r - t) % world)
            chosen.append(pick)
            candidates.remove(pick)
        out[shard] = tuple(sorted(chosen))
    return out


@dataclass(frozen=True)
class Holding:
    """What one rank of a new group holds in memory: the shards it saved or received at its
    last save, all of one version and one layout (``layout`` None: nothing, a joiner)."""

    version: StateVersion
    layout: Layout | None
    shards: tuple[int, ...]

    @property
    def trained(self) -> bool:
        return self.layout is not None and self.version.trained


@dataclass(frozen=True)
class RestorePoint:
    """A version every shard of which the new group holds: ``sources[s]`` are the new ranks
    holding shard ``s`` of ``layout``; ``values_from`` is a rank whose other state (sampler,
    plain values) was saved at that version."""

    version: StateVersion
    layout: Layout
    sources: Mapping[int, tuple[int, ...]]
    values_from: int = 0

    def holders(self) -> tuple[int, ...]:
        """Every new rank that holds some shard of it."""
        return tuple(sorted({r for ranks in self.sources.values() for r in ranks}))


def choose_restore(holdings: Sequence[Sequence[Holding]],
                   values: Sequence[StateVersion | None] | None = None) -> RestorePoint | None:
    """The newest (version, layout) that the ranks hold completely, or None.

    ``holdings[r]``: what new rank ``r`` holds (a rank may hold two versions: the last one
    every rank confirmed, and a newer one whose save was cut short after its copies
    arrived). ``values[r]``: the version of rank ``r``'s saved other state; a version counts
    only where some rank saved its other state at it too (None: every version counts, the
    values coming from its lowest holder). A version never mixes with another."""
    by_key: dict[tuple[StateVersion, Layout], dict[int, set[int]]] = {}
    for rank, held_here in enumerate(holdings):
        for holding in held_here:
            if not holding.trained:
                continue
            assert holding.layout is not None
            held = by_key.setdefault((holding.version, holding.layout), {})
            for shard in holding.shards:
                if 0 <= shard < holding.layout.shards:
                    held.setdefault(shard, set()).add(rank)
    candidates = []
    for key, held in by_key.items():
        if len(held) != key[1].shards:
            continue
        ranks = sorted({r for rs in held.values() for r in rs})
        if values is None:
            source: int | None = ranks[0]
        else:
            source = next((r for r, v in enumerate(values) if v == key[0]), None)
        if source is not None:
            candidates.append((key, source))
    if not candidates:
        return None
    (version, layout), source = max(candidates)
    held = by_key[(version, layout)]
    return RestorePoint(version, layout, {s: tuple(sorted(r)) for s, r in sorted(held.items())},
                        source)


def newest_held(holdings: Sequence[Sequence[Holding]]) -> StateVersion | None:
    """The newest version any rank holds a shard of (complete or not)."""
    versions = [h.version for held in holdings for h in held if h.trained]
    return max(versions) if versions else None


@dataclass(frozen=True)
class Move:
    """Rows of one tensor that one new rank needs: ``src_rows`` of old shard ``shard``'s local
    rows, held by new rank ``sender``, become ``dst_rows`` of new shard ``target``'s rows on
    new rank ``receiver`` (its own shard, or a copy it keeps of another)."""

    tensor: int
    shard: int
    sender: int
    receiver: int
    src_rows: tuple[int, int]
    dst_rows: tuple[int, int]
    target: int = 0

    @property
    def local(self) -> bool:
        return self.sender == self.receiver

    @property
    def count(self) -> int:
        return self.src_rows[1] - self.src_rows[0]


def wanted_shards(new: Layout, redundancy: int) -> list[tuple[int, int]]:
    """(rank, new shard) for every rank's own shard and every copy it keeps in ``new``
    (:func:`copy_holders`): what a new group needs in memory before it trains."""
    wanted = [(rank, new.shard_of(rank)) for rank in range(new.world)]
    for shard, holders in copy_holders(new, redundancy).items():
        wanted += [(holder, shard) for holder in holders]
    return wanted


def plan_moves(row_counts: Sequence[int], point: RestorePoint, new: Layout,
               wanted: Sequence[tuple[int, int]] | None = None) -> list[Move]:
    """Every move that gives each rank of ``new`` its rows of every tensor.

    ``row_counts[t]`` is tensor ``t``'s dim 0. ``wanted``: the (rank, new shard) pairs to
    fill, by default each rank's own shard (:func:`wanted_shards` adds the copies). The
    sender of old shard ``s``'s rows to new rank ``j`` is ``j`` itself when it holds ``s``,
    else one of ``s``'s holders, chosen by ``j`` so that the receivers of one shard spread
    over its holders.
    """
    old = point.layout
    if wanted is None:
        wanted = [(rank, new.shard_of(rank)) for rank in range(new.world)]
    moves: list[Move] = []
    for receiver, new_shard in wanted:
        for shard, holders in point.sources.items():
            sender = receiver if receiver in holders else holders[receiver % len(holders)]
            for t, n in enumerate(row_counts):
                o_lo, o_hi = rows(n, old.shards, shard)
                n_lo, n_hi = rows(n, new.shards, new_shard)
                lo, hi = max(o_lo, n_lo), min(o_hi, n_hi)
                if lo < hi:
                    moves.append(Move(t, shard, sender, receiver,
                                      (lo - o_lo, hi - o_lo), (lo - n_lo, hi - n_lo),
                                      new_shard))
    return moves


def senders_by_pair(moves: Iterable[Move]) -> dict[tuple[int, int], list[Move]]:
    """The moves that cross ranks, by (sender, receiver), each list in plan order."""
    pairs: dict[tuple[int, int], list[Move]] = {}
    for move in moves:
        if not move.local:
            pairs.setdefault((move.sender, move.receiver), []).append(move)
    return dict(sorted(pairs.items()))
