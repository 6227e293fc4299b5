"""The sharded-state planner (peer_elastic.sharded.plan): pure, simulated over random layouts.

Every property is checked over seeded random cases rather than a list of examples: rows agree
with torch.chunk (FSDP2's rule), copies survive any ``redundancy`` deaths, a restore never
mixes versions, and the moves give every new rank exactly its rows.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from peer_elastic.sharded.plan import (
    Holding,
    Layout,
    RestorePoint,
    choose_restore,
    copy_holders,
    mesh_shape,
    newest_held,
    plan_moves,
    rows,
    wanted_shards,
)
from peer_elastic.state.agreement import StateVersion

V1 = StateVersion(1, 5, 2, 9)
V2 = StateVersion(1, 6, 2, 12)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 33])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 8])
def test_rows_follow_torch_chunk(n: int, shards: int) -> None:
    chunks = torch.arange(n).chunk(shards) if n else ()
    for s in range(shards):
        lo, hi = rows(n, shards, s)
        want = chunks[s].tolist() if s < len(chunks) else []
        assert list(range(lo, hi)) == want


def test_mesh_shape_never_grows_a_shard() -> None:
    assert mesh_shape(3, None) == (1, 3)
    assert mesh_shape(4, 2) == (2, 2)
    assert mesh_shape(6, 2) == (3, 2)
    assert mesh_shape(5, 2) == (1, 5)  # 5 does not factor by 2: one group of 5
    assert mesh_shape(6, 4) == (1, 6)
    assert mesh_shape(8, 3) == (2, 4)
    assert mesh_shape(1, 2) == (1, 1)
    for world in range(1, 40):
        for degree in range(1, 10):
            replicas, shards = mesh_shape(world, degree)
            assert replicas * shards == world and shards >= min(degree, world)
    with pytest.raises(ValueError):
        mesh_shape(0, None)


def _layouts(rng: random.Random) -> Layout:
    world = rng.randint(1, 9)
    degree = rng.choice([None, 1, 2, 3])
    return Layout(rng.randint(1, 50), world, mesh_shape(world, degree)[1])


def test_copies_survive_any_redundancy_deaths() -> None:
    rng = random.Random(7)
    for _ in range(400):
        layout = _layouts(rng)
        k = rng.randint(0, 3)
        leaving = set(rng.sample(range(layout.world), rng.randint(0, layout.world - 1)))
        copies = copy_holders(layout, k, leaving)
        staying = [r for r in range(layout.world) if r not in leaving]
        for shard in range(layout.shards):
            holders = set(copies[shard]) | (set(layout.ranks_of(shard)) - leaving)
            assert not set(copies[shard]) & leaving
            assert not set(copies[shard]) & set(layout.ranks_of(shard))
            assert len(holders) >= min(k + 1, len(staying)), (layout, k, leaving, copies)
        # any k staying ranks may die: every shard still has a holder
        for dead in itertools.combinations(staying, min(k, len(staying) - 1)):
            for shard in range(layout.shards):
                holders = set(copies[shard]) | (set(layout.ranks_of(shard)) - leaving)
                assert holders - set(dead), (layout, k, leaving, dead, shard)


def test_fsdp_copies_are_spread_one_per_rank_and_not_on_the_youngest_neighbour() -> None:
    for world in range(2, 12):
        layout = Layout(1, world, world)
        for k in range(1, min(4, world)):
            copies = copy_holders(layout, k)
            load = [sum(r in held for held in copies.values()) for r in range(world)]
            assert load == [k] * world, (world, k, copies)
        if world >= 3:
            copies = copy_holders(layout, 1)
            # the two youngest ranks (leave first on a shrink) never hold each other's copy
            assert copies[world - 1] != (world - 2,) or copies[world - 2] != (world - 1,)


def test_hsdp_replicas_count_as_copies() -> None:
    assert copy_holders(Layout(1, 4, 2), 1) == {0: (), 1: ()}
    assert all(len(h) == 1 for h in copy_holders(Layout(1, 4, 2), 2).values())


def test_restore_takes_the_newest_complete_version_and_never_mixes() -> None:
    old = Layout(3, 3, 3)
    none = Holding(StateVersion(), None, ())
    # rank holding shard 1 (and its copy of 2) died: survivors hold 0 (+copy of 1), 2 (+ 0)
    holdings = [[Holding(V2, old, (0, 1))], [Holding(V2, old, (2, 0))], [none]]
    point = choose_restore(holdings)
    assert point is not None and point.version == V2 and point.layout == old
    assert dict(point.sources) == {0: (0, 1), 1: (0,), 2: (1,)}
    # one survivor saved V2, the other still V1: neither version is complete
    mixed = [[Holding(V2, old, (0, 1))], [Holding(V1, old, (2, 0))]]
    assert choose_restore(mixed) is None
    assert newest_held(mixed) == V2
    # an older complete version is taken when the newest is not complete
    older = [[Holding(V2, old, (0,))], [Holding(V1, old, (0, 1))], [Holding(V1, old, (2,))]]
    point = choose_restore(older)
    assert point is not None and point.version == V1
    # the same version in two layouts never mixes either
    relaid = [[Holding(V2, Layout(4, 2, 2), (0,))], [Holding(V2, old, (1, 2))]]
    assert choose_restore(relaid) is None
    assert choose_restore([[none]]) is None and choose_restore([[]]) is None


def test_a_save_cut_short_leaves_the_last_confirmed_version_or_the_new_one_whole() -> None:
    old = Layout(3, 3, 3)
    # every rank keeps its confirmed V1 save while V2's copies travel: V1 stays complete
    during = [[Holding(V1, old, (0, 1))], [Holding(V1, old, (1, 2)), Holding(V2, old, (1,))]]
    assert choose_restore(during, [V1, V2]).version == V1  # type: ignore[union-attr]
    # V2's copies all arrived (unconfirmed on one rank): V2, its values from a rank at V2
    after = [[Holding(V1, old, (0, 1)), Holding(V2, old, (0, 1))],
             [Holding(V2, old, (1, 2))]]
    point = choose_restore(after, [V2, V2])
    assert point is not None and point.version == V2 and point.values_from == 0
    # a complete version whose other state no rank saved does not count
    assert choose_restore(after, [V1, V1]) is None
    assert choose_restore(after, [None, None]) is None


def test_moves_give_every_new_rank_exactly_its_rows() -> None:
    rng = random.Random(11)
    for _ in range(300):
        old = _layouts(rng)
        world = rng.randint(1, 9)
        new = Layout(old.generation + 1, world, mesh_shape(world, rng.choice([None, 2]))[1])
        row_counts = [rng.randint(0, 20) for _ in range(rng.randint(1, 4))]
        # every old shard held by 1-3 random new ranks
        sources = {s: tuple(sorted(rng.sample(range(new.world), rng.randint(1, min(3, new.world)))))
                   for s in range(old.shards)}
        point = RestorePoint(V1, old, sources, 0)
        wanted = wanted_shards(new, rng.randint(0, 2))
        moves = plan_moves(row_counts, point, new, wanted)
        got: dict[tuple[int, int, int], list[int]] = {}
        for m in moves:
            assert m.sender in sources[m.shard]
            assert m.sender == m.receiver or m.receiver not in sources[m.shard]
            o_lo, _ = rows(row_counts[m.tensor], old.shards, m.shard)
            n_lo, _ = rows(row_counts[m.tensor], new.shards, m.target)
            src = list(range(o_lo + m.src_rows[0], o_lo + m.src_rows[1]))
            assert src == list(range(n_lo + m.dst_rows[0], n_lo + m.dst_rows[1]))
            got.setdefault((m.receiver, m.target, m.tensor), []).extend(src)
        assert all((r, new.shard_of(r)) in wanted for r in range(new.world))
        for receiver, target in wanted:
            for t, n in enumerate(row_counts):
                lo, hi = rows(n, new.shards, target)
                assert sorted(got.get((receiver, target, t), [])) == list(range(lo, hi))
