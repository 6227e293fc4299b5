"""The reset vote riding on DistributedOptimizer's gradient all-reduce and on DDP's with
pe.allreduce_hook (peer_elastic.torch.check.reset_vote): unit tests of the carrier, then real gloo
groups.

Every rank must take the same answer at the same check (so all raise together), the vote
must not change the averaged gradients by a bit where the buffer's length does not change how
the backend adds it up (3 ranks, small buffers: the tests here), and where no bucket can carry it (only
single-tensor buckets), no rank has a vote and the check falls back to its own exchange.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import peer_elastic as pe
from peer_elastic.torch.check.reset_vote import Ballot, ResetVote, current_vote, voting
from tests.helpers.world import run_world

STEPS = 6


def test_take_returns_the_latest_vote_of_the_group_once() -> None:
    group = object()
    vote = ResetVote(lambda: Ballot(group, False))
    assert vote.take(group) is None  # nothing counted yet
    ballot = vote.cast()
    assert ballot == Ballot(group, False)
    vote.counted(ballot, torch.zeros(1))
    vote.counted(ballot, torch.full((1,), 2.0))  # the latest step's count wins
    assert vote.take(group) is True
    assert vote.take(group) is None  # taken: the next check needs a new step


def test_the_vote_is_the_last_element_of_the_averaged_bucket() -> None:
    group = object()
    vote = ResetVote(lambda: Ballot(group, False))
    # Gradients first, the ballot element last, all divided by the world size (1024 here):
    # one rank of 1024 voting for a reset still reads as a reset; a big gradient does not.
    vote.counted(vote.cast(), torch.tensor([7.0, -3.0, 1.0]) / 1024)
    assert vote.take(group) is True
    vote.counted(vote.cast(), torch.tensor([7.0, 3.0, 0.0]) / 1024)
    assert vote.take(group) is False


def test_a_vote_of_another_group_is_dropped_unread() -> None:
    old, new = object(), object()
    vote = ResetVote(lambda: Ballot(old, True))
    vote.counted(vote.cast(), torch.ones(1))
    assert vote.take(new) is None
    assert vote.take(old) is None  # dropped, not kept for later


def test_a_kept_ballot_lasts_until_the_next_take() -> None:
    wishes = iter([False, True, True, False])
    vote = ResetVote(lambda: Ballot(1, next(wishes)))
    assert vote.cast_until_taken() == Ballot(1, False)
    assert vote.cast_until_taken() == Ballot(1, False)  # kept, though the wish changed
    vote.take(1)
    assert vote.cast_until_taken() == Ballot(1, True)  # cast anew after a take
    vote.clear()
    assert vote.cast_until_taken() == Ballot(1, False)  # and after a clear


def test_voting_makes_the_vote_current_only_inside() -> None:
    vote = ResetVote(lambda: None)
    assert current_vote() is None
    with voting(vote):
        assert current_vote() is vote
        vote.counted(Ballot(1, True), torch.ones(1))
    assert current_vote() is None
    assert vote.take(1) is None  # cleared on the way out


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights everywhere
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _vote_worker(rank: int, world: int, out: Path) -> None:
    """Rank world-1 wants a reset from step 3 on; every rank records what the check after
    each step would take, and the parameters after each step."""
    group = object()
    model = _model()
    opt = pe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step = 0
    vote = ResetVote(lambda: Ballot(group, rank == world - 1 and step >= 3))
    taken, params = [], []
    with voting(vote):
        for step in range(STEPS):
            opt.zero_grad()
            model(torch.full((1, 3), float(rank + step))).sum().backward()
            opt.step()
            taken.append(vote.take(group))
            params.append([p.detach().flatten().tolist() for p in model.parameters()])
    (out / f"{rank}.json").write_text(json.dumps({"taken": taken, "params": params}))


def _plain_worker(rank: int, world: int, out: Path) -> None:
    """The same steps with no vote current: the reference for the parameters."""
    model = _model()
    opt = pe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = []
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.full((1, 3), float(rank + step))).sum().backward()
        opt.step()
        params.append([p.detach().flatten().tolist() for p in model.parameters()])
    (out / f"plain-{rank}.json").write_text(json.dumps(params))


@pytest.mark.slow
def test_every_rank_takes_the_same_vote_and_gradients_are_unchanged(tmp_path: Path) -> None:
    world = 3
    run_world(_vote_worker, world, tmp_path)
    run_world(_plain_worker, world, tmp_path)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    expected = [step >= 3 for step in range(STEPS)]  # at the step it was cast, on all ranks
    assert all(r["taken"] == expected for r in results), [r["taken"] for r in results]
    plain = json.loads((tmp_path / "plain-0.json").read_text())
    for r in results:
        assert r["params"] == plain  # bit-identical to averaging without the vote


def _single_bucket_worker(rank: int, world: int, out: Path) -> None:
    """One parameter only: its bucket is reduced in place, so no step can carry a vote."""
    group = object()
    p = nn.Parameter(torch.ones(4))
    opt = pe.DistributedOptimizer(torch.optim.SGD([p], lr=1.0))
    vote = ResetVote(lambda: Ballot(group, True))
    with voting(vote):
        (p * (rank + 1)).sum().backward()
        opt.step()
        taken = vote.take(group)
    (out / f"{rank}.json").write_text(json.dumps({"taken": taken, "p": p.tolist()}))


@pytest.mark.slow
def test_no_carrier_bucket_means_no_vote_on_any_rank(tmp_path: Path) -> None:
    run_world(_single_bucket_worker, 2, tmp_path)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [r["taken"] for r in results] == [None, None]
    assert results[0]["p"] == results[1]["p"] == [-0.5] * 4  # 1 - (1 + 2) / 2


@pytest.mark.parametrize("averaging", ["DistributedOptimizer", "DDP with pe.allreduce_hook"])
@pytest.mark.slow
def test_a_check_after_an_averaging_step_runs_no_collective(
        etcd: str, unique_job: str, averaging: str) -> None:
    """Real etcd, two real peers: 30 steps, a check after each, 30 all-reduces in all (the
    optimizer's, or DDP's one bucket); a hand-written exchange per check would make it 60."""
    from tests.helpers.procs import Cluster

    cluster = Cluster(etcd, unique_job, PEER_ELASTIC_MIN_NP=2, PEER_ELASTIC_MAX_NP=2,
                      WORKER_STEPS=30, WORKER_DDP=int(averaging.startswith("DDP")))
    try:
        peers = cluster.start(2, module="tests.helpers.vote_worker")
        for p in peers:
            line = p.wait_line("COUNTED", timeout=120)
            assert line.split()[1:] == ["30", "30"], line
            assert p.wait(timeout=60) == 0
    finally:
        cluster.close()


# --- DDP: pe.allreduce_hook -------------------------------------------------------------------

def _ddp_model(shape: str) -> nn.Module:
    torch.manual_seed(0)
    if shape == "big_first":  # DDP's first bucket (the last layer's) is over RIDER_BYTES
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 270_000, bias=False))
    if shape == "all_big":  # one bucket, over RIDER_BYTES: nothing can carry the vote
        return nn.Sequential(nn.Linear(600, 600, bias=False))
    if shape == "unused":  # a layer the forward never uses (find_unused_parameters)
        return _WithUnused()
    return _model()


class _WithUnused(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[2](self[1](self[0](x)))  # never the last layer


def _ddp_run(rank: int, world: int, shape: str, hook: bool) -> dict:
    """What the check after each step would take, and the parameters after each step, with
    DDP (its own reducer, or pe.allreduce_hook with rank world-1 voting from step 3 on)."""
    import torch.distributed as dist

    group = object()
    models = [_ddp_model(shape)] + ([_ddp_model(shape)] if shape == "two" else [])
    pg = None
    if shape == "pairs":  # DDP over a data-parallel pair of a 4-rank job
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pg = pairs[rank // 2]
    if shape == "three":  # 3 ranks: averaging by 1/3 must round as DDP's own reducer does
        three, alone = dist.new_group([0, 1, 2]), dist.new_group([3])
        pg = three if rank < 3 else alone
    wrappers = []
    for model in models:
        # big_first: 1 MB buckets, so the big layer's bucket is not the last one reduced;
        # views: the gradients are views of DDP's buckets (the hook's result is copied in)
        ddp = nn.parallel.DistributedDataParallel(
            model, process_group=pg, bucket_cap_mb=1 if shape == "big_first" else 25,
            gradient_as_bucket_view=shape == "views", static_graph=shape == "static",
            find_unused_parameters=shape == "unused")
        if hook:
            ddp.register_comm_hook(pg, pe.allreduce_hook)
        wrappers.append(ddp)
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    step, calls = 0, 0

    def ballot() -> Ballot:
        # two: each pass casts twice (one rider per wrapper, both in flight), and rank
        # world-1's wish flips between the two casts: both riders must carry the first.
        nonlocal calls
        calls += 1
        flip = shape != "two" or calls % 2 == 1
        return Ballot(group, rank == world - 1 and step >= 3 and flip)

    vote = ResetVote(ballot)
    taken, after = [], []
    with voting(vote):
        for step in range(STEPS):
            opt.zero_grad()
            x = torch.full((2, models[0][0].in_features), float(rank + step))
            if shape == "accum":  # gradient accumulation: a pass without DDP's all-reduce
                with wrappers[0].no_sync():
                    wrappers[0](-x).pow(2).sum().backward()
            sum(ddp(x).pow(2).sum() for ddp in wrappers).backward()
            opt.step()
            taken.append(vote.take(group))
            after.append([p.detach().flatten()[:64].tolist() + [float(p.detach().double().sum())]
                          for p in params])
    return {"taken": taken, "params": after}


# What every rank's check after each step takes with the hook, by shape. big_first: the first
# bucket is too big to copy; the next one carries the vote, once DDP has cut its buckets (its
# first pass has one bucket of everything). all_big: no bucket is small enough; pairs and three:
# DDP over a group smaller than the job (the other ranks would not see the vote). No rank has a
# vote there: each check exchanges its own. two: two wrappers in one backward pass. static,
# unused, accum: DDP's static_graph, find_unused_parameters, and a no_sync() pass before each
# step (no hook runs in it).
_WANTED = [step >= 3 for step in range(STEPS)]  # from the step it was cast, on all ranks
DDP_TAKEN = {"small": _WANTED, "big_first": [None, *_WANTED[1:]], "all_big": [None] * STEPS,
             "pairs": [None] * STEPS, "three": [None] * STEPS, "views": _WANTED,
             "two": _WANTED, "static": _WANTED, "unused": _WANTED, "accum": _WANTED}


def _flat(params: list) -> list[float]:
    return [x for step in params for p in step for x in p]


def _ddp_worker(rank: int, world: int, out: Path) -> None:
    """Each shape with and without the hook, in one group (4 ranks: "pairs" needs them)."""
    results = {f"{shape}-{int(hook)}": _ddp_run(rank, world, shape, hook)
               for shape in DDP_TAKEN for hook in (False, True)}
    (out / f"ddp-{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_ddp_hook_carries_the_vote_on_every_rank_and_keeps_ddps_gradients(
        tmp_path: Path) -> None:
    world = 4
    run_world(_ddp_worker, world, tmp_path)
    ranks = [json.loads((tmp_path / f"ddp-{r}.json").read_text()) for r in range(world)]
    for shape, taken in DDP_TAKEN.items():
        assert all(r[f"{shape}-1"]["taken"] == taken for r in ranks), (shape, ranks)
        assert all(r[f"{shape}-0"]["taken"] == [None] * STEPS for r in ranks), shape
        # Every rank of a DDP group holds the same parameters, to the bit.
        groups = {"pairs": [[0, 1], [2, 3]], "three": [[0, 1, 2]]}.get(shape, [[0, 1, 2, 3]])
        for members in groups:
            assert all(ranks[m][f"{shape}-1"]["params"] == ranks[members[0]][f"{shape}-1"]["params"]
                       for m in members), shape
        hooked, reducer = ranks[0][f"{shape}-1"]["params"], ranks[0][f"{shape}-0"]["params"]
        if taken == [None] * STEPS:  # no rider: DDP's own averaging, to the bit (three: 1/3)
            assert hooked == reducer, shape
        else:  # the rider is one element longer: gloo at 4 ranks may add some in another order
            assert torch.allclose(torch.tensor(_flat(hooked)), torch.tensor(_flat(reducer)),
                                  rtol=1e-5, atol=1e-7), shape
