"""After a reset, ranks agree on the newest state version and sync from whoever holds it.

The rule itself (``peer_elastic.state.agreement.agree``) is pure and tested first; then the
collective ``agree_and_sync`` on real gloo groups, including the cases issue 9 measured: a
rank restored to commit k next to one live at k plus m steps, and a member returning with
stale state whose commit count equals the survivors'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from peer_elastic.state import TorchState
from peer_elastic.state.agreement import Agreement, Claim, StateVersion, agree
from peer_elastic.state.sampler import ElasticSampler
from peer_elastic.state.sync import agree_and_sync
from tests.helpers.world import run_world as _run_world


def V(*parts: int) -> StateVersion:  # noqa: N802 - reads as the type it builds
    """A version of lineage 1 from (commits, generation, step); V() is the initial one."""
    return StateVersion(1, *parts) if parts else StateVersion()

# --- the rule ------------------------------------------------------------------------------------


def test_versions_order_by_commits_then_generation_then_step() -> None:
    assert V(2, 1, 1) > V(1, 9, 9) > V(1, 9, 8) > V(1, 8, 50) > V()
    assert StateVersion(2, 0, 1, 1) > V(50, 9, 9)  # a later lineage wins whatever it counts
    assert V(3, 4, 5).stepped(4) == V(3, 4, 6)
    assert V(3, 4, 5).stepped(6) == V(3, 6, 1)  # the first check in a new generation
    assert V(3, 4, 5).committed() == V(4, 4, 5)


def test_equal_versions_without_need_skip_the_sync() -> None:
    assert agree([Claim(V(2, 3, 4), False)] * 3) == Agreement(None, V(2, 3, 4))


def test_the_lowest_rank_holding_the_newest_version_is_the_source() -> None:
    claims = [Claim(V(2, 3, 4), False), Claim(V(2, 3, 9), False), Claim(V(2, 3, 9), False)]
    assert agree(claims) == Agreement(1, V(2, 3, 9))


def test_a_joiner_forces_a_sync_even_when_versions_match() -> None:
    claims = [Claim(V(2, 3, 4), False), Claim(V(2, 3, 4), True)]
    assert agree(claims) == Agreement(0, V(2, 3, 4))


def test_a_fresh_group_syncs_from_rank_zero() -> None:
    assert agree([Claim(V(), True)] * 3) == Agreement(0, V())


def test_claims_survive_the_wire_and_junk_is_refused() -> None:
    c = Claim(V(7, 8, 9), True)
    assert Claim.from_ints(c.as_ints()) == c
    with pytest.raises(ValueError):
        Claim.from_ints([0, -1, 0, 0])
    with pytest.raises(ValueError):
        agree([])


# --- the collective, on real gloo groups --------------------------------------------------------


def _state(seed: int) -> TorchState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      sampler=ElasticSampler(range(30), seed=0, pad=False), epoch=0)


def _dump(out: Path, rank: int, state: TorchState, agreement: Agreement, **extra: object) -> None:
    (out / f"{rank}.json").write_text(json.dumps({
        "src": agreement.source, "version": agreement.version.as_ints(),
        "commit": state.commit_count, "epoch": state.epoch,
        "processed": sorted(torch.nonzero(state.sampler.processed_mask).flatten().tolist()),
        "w": state.model.weight.detach().flatten().tolist(), **extra,
    }))


def _roll_forward(rank: int, world: int, out: Path) -> None:
    # Rank 1 completed one more commit than ranks 0 and 2 (its check collective finished,
    # theirs failed); its commit must win, although it is not rank 0.
    state = _state(0)
    state.record_commit()
    version = V(1, 5, 3)
    if rank == 1:
        state.sampler.record_batch(0, 2)
        state.epoch = 7
        state.model.weight.data.add_(1.0)
        state.record_commit()
        version = version.committed()
    agreement = agree_and_sync(state, Claim(version, False), torch.device("cpu"))
    w = state.model.weight.detach().clone()
    state.model.weight.data.add_(1.0)  # live change after the sync ...
    state.restore()  # ... a failure now must return to the synced state
    _dump(out, rank, state, agreement, restored_equal=bool(torch.equal(state.model.weight, w)))


@pytest.mark.slow
def test_ranks_adopt_the_newest_commit_from_whichever_rank_holds_it(tmp_path: Path) -> None:
    _run_world(_roll_forward, 3, tmp_path)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert {g["src"] for g in got} == {1}
    assert {g["commit"] for g in got} == {2} and {g["epoch"] for g in got} == {7}
    assert all(len(g["processed"]) == 6 for g in got)  # batch 0 of all 3 ranks, 2 samples each
    assert got[0]["w"] == got[1]["w"] == got[2]["w"]
    assert all(g["restored_equal"] for g in got)


def _restored_next_to_live(rank: int, world: int, out: Path) -> None:
    # Issue 9, item 4: rank 0 restored commit k (its check failed), rank 1 kept live state
    # k + 3 steps (the same check completed there). Both have k commits. The source must be
    # rank 1, and the progress must be rank 1's own: never rank 0's model with a union of
    # bitmaps, which would mark samples done that rank 0's model never saw.
    state = _state(0)
    state.record_commit()
    version = V(1, 4, 2)
    if rank == 1:
        state.sampler.record_indices([3, 4, 5])
        state.model.weight.data.add_(3.0)  # the three steps' contributions
        version = V(1, 4, 5)
    else:
        state.sampler.record_indices([20, 21])  # recorded, then restored away
        state.restore()
    agreement = agree_and_sync(state, Claim(version, False), torch.device("cpu"))
    _dump(out, rank, state, agreement)


@pytest.mark.slow
def test_a_live_rank_ahead_of_a_restored_one_with_equal_commits_wins(tmp_path: Path) -> None:
    _run_world(_restored_next_to_live, 2, tmp_path)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert {g["src"] for g in got} == {1}
    assert got[0]["processed"] == got[1]["processed"] == [3, 4, 5]
    assert got[0]["w"] == got[1]["w"]


def _stale_member_returns(rank: int, world: int, out: Path) -> None:
    # Issue 9, scenario 2: rank 2 was parked at (1 commit, generation 3, step 10) and comes
    # back; the survivors trained 30 more checks in generation 4 without committing. Equal
    # commit counts, different states: everyone must end with the survivors' state.
    state = _state(rank)  # different weights everywhere
    if rank < 2:
        state = _state(0)
        state.model.weight.data.add_(5.0)
        version = V(1, 4, 30)
    else:
        version = V(1, 3, 10)
    agreement = agree_and_sync(state, Claim(version, rank == 2), torch.device("cpu"))
    _dump(out, rank, state, agreement)


@pytest.mark.slow
def test_a_returning_member_with_stale_state_is_synced(tmp_path: Path) -> None:
    _run_world(_stale_member_returns, 3, tmp_path)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert {g["src"] for g in got} == {0}
    assert {tuple(g["version"]) for g in got} == {(1, 1, 4, 30)}
    assert got[0]["w"] == got[1]["w"] == got[2]["w"]


def _removals_only(rank: int, world: int, out: Path) -> None:
    state = _state(0)  # identical everywhere, same version: nothing to sync
    state.record_commit()
    agreement = agree_and_sync(state, Claim(V(1, 2, 3), False), torch.device("cpu"))
    _dump(out, rank, state, agreement)


@pytest.mark.slow
def test_identical_versions_and_no_need_skip_the_sync(tmp_path: Path) -> None:
    _run_world(_removals_only, 2, tmp_path)
    assert [json.loads((tmp_path / f"{r}.json").read_text())["src"] for r in range(2)] == [None] * 2


def test_holders_are_the_ranks_at_the_agreed_version_that_kept_their_state() -> None:
    from peer_elastic.state.agreement import holders

    claims = [Claim(V(2, 3, 4), False), Claim(V(2, 3, 4), True), Claim(V(1, 3, 4), False),
              Claim(V(2, 3, 4), False)]
    assert holders(claims, agree(claims).version) == (0, 3)
    assert holders([Claim(V(), True)] * 2, V()) == ()
