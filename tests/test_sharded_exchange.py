"""Sharded state's moving parts on a real multi-process gloo group (no etcd).

``transfer`` moves mixed lists (large tensors alone, small ones packed, destinations laid
out back to back or scattered), and a ShardedState saved at one world size comes back bit
for bit from ``regroup`` at another (3 -> 2 after a rank is gone, 2 -> 3 with a joiner that
holds nothing), its gathered parameters and Adam state compared with the saved ones.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from peer_elastic.sharded.exchange import DIRECT_BYTES, flat_views, transfer
from peer_elastic.state.agreement import Claim, StateVersion
from tests.helpers.world import run_world


def _payload(peer: int, tag: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(peer * 100 + tag)
    big = DIRECT_BYTES // 4 + 3
    return [torch.randn(5, 3, generator=g), torch.randn(big, generator=g),
            torch.arange(7, dtype=torch.int64) + peer, torch.randn(0, 4, generator=g),
            torch.randn(2, 2, generator=g).double()]


def _exchange(rank: int, world: int, out: Path) -> None:
    outgoing = {p: _payload(rank, p) for p in range(world) if p != rank}
    incoming: dict[int, list[torch.Tensor]] = {}
    for p in range(world):
        if p == rank:
            continue
        want = _payload(p, rank)
        if p % 2:  # laid out back to back: received where it lies
            incoming[p] = flat_views([(tuple(t.shape), t.dtype) for t in want], torch.device("cpu"))
        else:  # scattered: slices of bigger tensors
            incoming[p] = [torch.zeros(2 * max(t.shape[0], 1), *t.shape[1:], dtype=t.dtype)
                           [:t.shape[0]] if t.dim() else torch.zeros((), dtype=t.dtype)
                           for t in want]
    transfer(outgoing, incoming)
    ok = all(torch.equal(got, want) for p, ts in incoming.items()
             for got, want in zip(ts, _payload(p, rank), strict=True))
    (out / f"{rank}.json").write_text(json.dumps(ok))


@pytest.mark.slow
def test_transfer_moves_mixed_lists_between_every_pair(tmp_path: Path) -> None:
    run_world(_exchange, 3, tmp_path)
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)] == [True] * 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _parallelize(model: nn.Module, mesh: object) -> nn.Module:
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _gathered(state: object) -> dict[str, list]:
    from torch.distributed.tensor import DTensor

    out = {}
    model, opt = state.model, state.optimizer  # type: ignore[attr-defined]
    for name, p in sorted(model.named_parameters()):
        out[name] = p.full_tensor().tolist()
        for key, v in sorted(opt.state[p].items()):
            out[f"{name}/{key}"] = (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
    return out


def _round_trip(rank: int, world: int, out: Path, first: int, second: int) -> None:
    """Generation 1: ranks below ``first`` train and save; generation 2: ranks below
    ``second`` take the state over (fewer: the others are gone; more: joiners holding
    nothing). Each generation is a new default group, as the run loop makes them."""
    import peer_elastic as pe
    from peer_elastic.sharded.regroup import regroup

    dist.destroy_process_group()  # run_world's group: the generations make their own
    state = pe.ShardedState(model=_Net, parallelize=_parallelize,
                            optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                            epoch=0)
    cpu = torch.device("cpu")
    version = StateVersion(7, 3, 1, 5)
    if rank < first:
        dist.init_process_group("gloo", store=dist.FileStore(str(out / "gen1"), first),
                                rank=rank, world_size=first)
        regroup(state, Claim(StateVersion(), True), cpu, 1)
        for step in range(3):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank * 10 + step))
            state.optimizer.zero_grad()
            state.model(x).pow(2).sum().backward()
            state.optimizer.step()
        state.expect_save(version)
        state.save()
        before = _gathered(state)
        if rank == 0:
            (out / "before.json").write_text(json.dumps(before))
        dist.destroy_process_group()
    if rank < second:
        dist.init_process_group("gloo", store=dist.FileStore(str(out / "gen2"), second),
                                rank=rank, world_size=second)
        claim = Claim(version, False) if rank < first else Claim(StateVersion(), True)
        agreement, _ = regroup(state, claim, cpu, 2)
        after = _gathered(state)
        (out / f"after{rank}.json").write_text(json.dumps(
            {"version": list(agreement.version.as_ints()), "state": after,
             "layout": [state.layout.replicas, state.layout.shards]}))
        # A step, then a failure before the next commit: the next group must find the state
        # the reshard saved, not the one trained since (nothing saved may alias live state).
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(99 + rank))
        state.optimizer.zero_grad()
        state.model(x).pow(2).sum().backward()
        state.optimizer.step()
        state.restore()
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.FileStore(str(out / "gen3"), second),
                                rank=rank, world_size=second)
        regroup(state, Claim(agreement.version, False), cpu, 3)
        (out / f"again{rank}.json").write_text(json.dumps(_gathered(state) == after))
    # run_world destroys the default group at the end: give it one to destroy
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(out / f"end{rank}"), 1), rank=0,
                            world_size=1)


def _check_round_trip(out: Path, second: int) -> None:
    before = json.loads((out / "before.json").read_text())
    for rank in range(second):
        after = json.loads((out / f"after{rank}.json").read_text())
        assert after["version"] == [7, 3, 1, 5]
        assert after["layout"] == [1, second]
        assert after["state"] == before, rank  # gathered params and Adam state, exactly
        assert json.loads((out / f"again{rank}.json").read_text()), rank


@pytest.mark.slow
def test_a_sharded_state_comes_back_bit_identical_at_fewer_ranks(tmp_path: Path) -> None:
    run_world(functools.partial(_round_trip, first=3, second=2), 3, tmp_path)
    _check_round_trip(tmp_path, 2)


@pytest.mark.slow
def test_a_sharded_state_comes_back_bit_identical_with_a_joiner(tmp_path: Path) -> None:
    run_world(functools.partial(_round_trip, first=2, second=3), 3, tmp_path)
    _check_round_trip(tmp_path, 3)


def test_sharded_state_refuses_what_cannot_be_rebuilt_and_says_why() -> None:
    import pytest

    import peer_elastic as pe

    with pytest.raises(TypeError, match="function that builds the module"):
        pe.ShardedState(model=_Net(), parallelize=_parallelize)
    with pytest.raises(TypeError, match="not an optimizer"):
        net = _Net()
        pe.ShardedState(model=_Net, parallelize=_parallelize,
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="shard_degree"):
        pe.ShardedState(model=_Net, parallelize=_parallelize, shard_degree=0)
    with pytest.raises(ValueError, match="redundancy"):
        pe.ShardedState(model=_Net, parallelize=_parallelize, redundancy=-1)
    with pytest.raises(ValueError, match="reserved"):
        pe.ShardedState(model=_Net, parallelize=_parallelize, mesh=1)
    state = pe.ShardedState(model=_Net, parallelize=_parallelize, epoch=3)
    assert state.epoch == 3 and state.layout is None and state.holdings() == ()
    with pytest.raises(RuntimeError, match="inside the training function"):
        _ = state.model
