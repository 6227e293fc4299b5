"""State / ObjectState / TorchState: commit, restore, the pickle-free codec, handlers, and a real
3-process sync that must leave every rank bit-identical."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.errors import HostsUpdatedInterrupt
from peer_elastic.state import ObjectState, State, TorchState
from peer_elastic.state.codec import decode_values, encode_values
from peer_elastic.state.handlers import (
    ModuleHandler,
    StateHandler,
    make_handler,
    register_handler,
    unregister_handler,
)
from peer_elastic.state.sampler import ElasticSampler
from peer_elastic.torch.transport.buckets import halves
from peer_elastic.torch.transport.collectives import (
    SourceCannotSend,
    broadcast_bytes,
    broadcast_plain,
    broadcast_tensors,
)
from peer_elastic.torch.transport.layout_check import broadcast_validated, start_layout_check
from peer_elastic.torch.transport.sync_source import syncing_from

# --- helpers ---------------------------------------------------------------------------------


def _net(hidden: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 3)
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-identical comparison of nested state (tensors: same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def clean_registry():
    from peer_elastic.state import handlers

    saved = handlers.registered_handlers()
    yield
    for type_, _ in handlers.registered_handlers():
        unregister_handler(type_)
    for type_, factory in saved:
        register_handler(type_, factory)


# --- commit / restore ------------------------------------------------------------------------


def test_commit_restore_round_trip_model_and_adam() -> None:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TorchState(model, opt, epoch=0)
    assert state.model is model and state.optimizer is opt
    _train(model, opt, 2, seed=1)
    state.epoch = 1
    state.commit()
    model_ref = copy.deepcopy(model.state_dict())
    opt_ref = copy.deepcopy(opt.state_dict())
    assert isinstance(opt_ref["state"][0]["step"], torch.Tensor)  # tensor step (recent torch)

    _train(model, opt, 3, seed=2)
    opt.param_groups[0]["lr"] = 0.5
    state.epoch = 7
    state.restore()

    _assert_same(model.state_dict(), model_ref)
    _assert_same(opt.state_dict(), opt_ref)
    assert state.epoch == 1
    # Training on from the restore point equals training on from a fresh copy of the commit.
    twin = _net()
    twin.load_state_dict(model_ref)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(opt_ref)
    _train(model, opt, 2, seed=3)
    _train(twin, twin_opt, 2, seed=3)
    _assert_same(model.state_dict(), twin.state_dict())
    _assert_same(opt.state_dict(), twin_opt.state_dict())


def test_restore_drops_state_created_after_the_save_and_recreates_deleted() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt)  # saved with an empty optimizer state
    _train(model, opt, 2, seed=0)
    assert len(opt.state) > 0
    state.restore()
    assert len(opt.state) == 0

    _train(model, opt, 2, seed=0)
    state.commit()
    ref = copy.deepcopy(opt.state_dict())
    opt.state.clear()
    first = next(iter(model.parameters()))
    opt.state[first]["extra"] = torch.zeros(3)  # a key that did not exist at the save
    state.restore()
    _assert_same(opt.state_dict(), ref)


def test_restore_before_any_commit_returns_to_construction() -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    ref = copy.deepcopy(model.state_dict())
    state = TorchState(model, opt, batch=0)
    _train(model, opt, 1, seed=0)
    state.batch = 5
    state.restore()
    _assert_same(model.state_dict(), ref)
    assert state.batch == 0 and len(opt.state) == 0


def test_commit_reuses_its_buffers() -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1, seed=0)
    state = TorchState(model, opt)
    handlers = state._handlers
    before = [handlers["model"]._buffers.data_ptrs(), handlers["optimizer"]._buffers.data_ptrs()]
    live = {t.data_ptr() for t in model.state_dict().values()}
    for seed in range(3):
        _train(model, opt, 1, seed=seed)
        state.commit()
    after = [handlers["model"]._buffers.data_ptrs(), handlers["optimizer"]._buffers.data_ptrs()]
    assert before == after  # allocated once, refilled with copy_
    assert not live & set(after[0])  # copies, not aliases
    assert state.commit_count == 3 and state.last_commit_time is not None


def test_tied_weights_are_saved_once_and_restored() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    state = TorchState(model)
    assert len(state._handlers["model"]._buffers.data_ptrs()) == 1
    ref = emb.weight.detach().clone()
    with torch.no_grad():
        head.weight.add_(1.0)
    state.restore()
    assert torch.equal(emb.weight, ref) and head.weight is emb.weight


def test_module_restore_refuses_changed_structure() -> None:
    model = _net()
    state = TorchState(model)
    model[0] = nn.Linear(6, 17)
    with pytest.raises(RuntimeError, match="structure changed"):
        state.restore()


def test_tensor_and_lr_scheduler_values() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    metric = torch.zeros(2)
    state = TorchState(model, opt, sched=sched, metric=metric)
    metric += 3
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    state.restore()
    assert state.metric is metric and torch.equal(metric, torch.zeros(2))
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 1.0


def test_reassigning_a_handled_attribute_gets_a_new_handler() -> None:
    state = TorchState(_net())
    new = _net(hidden=4)
    state.model = new
    assert state.model is new and state._handlers["model"].value is new
    with pytest.raises(TypeError, match="no handler"):
        state.model = 3


# --- host updates and reset --------------------------------------------------------------------


def test_commit_saves_then_raises_from_the_attached_checker() -> None:
    state = ObjectState(batch=0)
    state.commit()  # detached: just a save
    pending = {"flag": False}

    def checker(s: State, committing: bool) -> None:
        if committing:  # the run loop's checker saves once the ranks agreed
            s.record_commit()
        if pending["flag"]:
            raise HostsUpdatedInterrupt(skip_sync=True)

    state.attach(checker)
    state.batch = 4
    state.commit()
    pending["flag"] = True
    state.batch = 5
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync
    state.batch = 99
    state.restore()
    assert state.batch == 5  # the save happened before the check raised
    assert state.commit_count == 3
    state.attach(None)
    state.check_host_updates()


def test_on_reset_runs_handler_resets_then_callbacks_in_order() -> None:
    sampler = ElasticSampler(range(12))
    state = TorchState(sampler=sampler)
    calls: list[str] = []
    state.register_reset_callbacks([lambda: calls.append(f"a{sampler.num_replicas}")])
    state.register_reset_callbacks([lambda: calls.append("b")])
    sampler._pinned_world = (0, 3)  # the new group, before the sampler re-partitions
    state.on_reset()
    assert calls == ["a3", "b"] and len(sampler) == 4
    with pytest.raises(TypeError):
        state.register_reset_callbacks([1])


def test_base_state_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        State().commit()


# --- ObjectState and the codec -------------------------------------------------------------------


def test_object_state_attributes_save_restore_nested() -> None:
    state = ObjectState(epoch=2, history=[[1, 2], {"k": (3, 4)}])
    state.history[0].append(99)
    state.history[1]["new"] = 1
    state.restore()
    assert state.history == [[1, 2], {"k": (3, 4)}]
    state.history[0].append(5)
    state.commit()
    state.history[0].clear()
    state.restore()
    assert state.history[0] == [1, 2, 5]
    state.restore()
    state.history[0].clear()  # restore hands out copies: the snapshot stays intact
    state.restore()
    assert state.history[0] == [1, 2, 5]


@pytest.mark.parametrize("name", ["commit", "sync", "_x", "commit_count"])
def test_reserved_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        ObjectState(**{name: 1})


_ODD_VALUES = {
    "none": None,
    "flag": True,
    "big": 2**80,
    "neg": -7,
    "f": 1.5,
    "negzero": -0.0,
    "inf": float("inf"),
    "text": "äöü 🚀",
    "raw": b"\x00\xffabc",
    "nested": [(1, [b"", ()]), {"a": {1: (2.5, None)}, (1, "x"): [], 3: {}}],
    "empty": [[], (), {}],
}


def test_codec_round_trips_plain_values_exactly() -> None:
    decoded = decode_values(encode_values(_ODD_VALUES))
    assert decoded == _ODD_VALUES
    assert math.copysign(1, decoded["negzero"]) == -1
    assert type(decoded["nested"][0]) is tuple and type(decoded["nested"][1]) is dict
    nan = decode_values(encode_values({"x": float("nan")}))["x"]
    assert math.isnan(nan)


def test_codec_turns_numpy_scalars_into_builtins() -> None:
    decoded = decode_values(
        encode_values({"a": np.float64(0.25), "b": np.int64(3), "c": np.bool_(True)})
    )
    assert decoded == {"a": 0.25, "b": 3, "c": True}
    assert [type(v) for v in decoded.values()] == [float, int, bool]


def test_codec_sends_subclasses_of_plain_types_as_the_builtin() -> None:
    # The exact builtins take a fast path; a subclass of str or int (an enum) goes the long
    # way and arrives as its builtin base. A tuple subclass stays refused: its fields would
    # come back nameless.
    import collections
    import enum

    class Mode(str, enum.Enum):
        FAST = "fast"

    class Level(enum.IntEnum):
        HIGH = 3

    decoded = decode_values(encode_values({"mode": Mode.FAST, "level": [Level.HIGH]}))
    assert decoded == {"mode": "fast", "level": [3]}
    assert type(decoded["mode"]) is str and type(decoded["level"][0]) is int
    with pytest.raises(TypeError, match="state.pair is a"):
        encode_values({"pair": collections.namedtuple("Pair", "a b")(1, 2)})


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (object(), "ObjectState.cfg"),
        ({"a": [1, {2}]}, "ObjectState.cfg['a'][1]"),
        ((1, 2, {3}), "ObjectState.cfg[2] is a builtins.set"),
        ({(1, frozenset()): 1}, "ObjectState.cfg key[1] is a builtins.frozenset"),
        (np.zeros(3), "ObjectState.cfg"),
        (torch.zeros(1), "ObjectState.cfg"),
    ],
)
def test_sync_refuses_unsupported_types_with_a_clear_error(value: Any, where: str) -> None:
    state = ObjectState(cfg=value)
    state.commit()  # saving is fine; only sending needs the codec
    with pytest.raises(TypeError) as info:
        state.sync()
    assert where in str(info.value) and "register_handler" in str(info.value)


@pytest.mark.parametrize(
    "data", [b'{"x": {"zz": 1}}', b"[1]", b'{"x": {"b": "!!"}}', b'{"x": {"d": [[[1], 2]]}}']
)
def test_decoder_rejects_malformed_payloads(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_values(data)


def test_collectives_are_no_ops_without_a_group() -> None:
    t = torch.ones(3)
    broadcast_tensors([t])
    assert broadcast_plain({"a": (1,)}) == {"a": (1,)}
    state = TorchState(_net(), epoch=1)
    state.sync()
    assert state.epoch == 1


# --- handler registry ------------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.n = 0


class _CounterHandler(StateHandler):
    def __init__(self, value: _Counter) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = self.value.n

    def restore(self) -> None:
        self.value.n = self._saved

    def sync(self) -> None:
        self.value.n = broadcast_plain(self.value.n, what="counter")


class _SpecialNet(nn.Linear):
    pass


def test_registered_handler_manages_a_custom_type(clean_registry) -> None:
    counter = _Counter()
    with pytest.raises(TypeError):
        ObjectState(counter=counter).sync()  # unknown type: not sendable
    assert TorchState.register_handler is register_handler
    TorchState.register_handler(_Counter, _CounterHandler)
    state = TorchState(counter=counter)
    assert state.counter is counter and isinstance(state._handlers["counter"], _CounterHandler)
    counter.n = 5
    state.commit()
    counter.n = 9
    state.restore()
    assert counter.n == 5
    assert unregister_handler(_Counter) and not unregister_handler(_Counter)
    assert make_handler(counter) is None


def test_user_registrations_come_first_and_replace(clean_registry) -> None:
    class First(ModuleHandler):
        pass

    class Second(ModuleHandler):
        pass

    assert type(make_handler(_SpecialNet(2, 2))) is ModuleHandler
    register_handler(_SpecialNet, First)
    register_handler(nn.Linear, Second)
    assert type(make_handler(_SpecialNet(2, 2))) is First  # registration order
    assert type(make_handler(nn.Linear(2, 2))) is Second
    register_handler(_SpecialNet, Second)  # same type again: replaced in place
    assert type(make_handler(_SpecialNet(2, 2))) is Second
    register_handler(_Counter, lambda value: "not a handler")
    with pytest.raises(TypeError, match="returned"):
        make_handler(_Counter())
    with pytest.raises(TypeError):
        register_handler("x", First)


# --- real processes: sync must make every rank bit-identical ------------------------------------------

from tests.helpers.world import run_world as _run_world  # noqa: E402


def _build_state(rank: int) -> TorchState:
    torch.manual_seed(100 + rank)  # every rank starts from different weights
    model, aux = _net(), nn.Linear(5, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    aux_opt = torch.optim.SGD(aux.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(40), seed=rank)
    state = TorchState(
        model,
        opt,
        aux=aux,
        aux_opt=aux_opt,
        sampler=sampler,
        metric=torch.full((3,), float(rank)),
        epoch=rank,
        meta={"rank": rank, "tags": ("a", rank), "raw": bytes([rank])},
    )
    if rank == 0:  # the oldest member: trained further, different hyper-parameters
        _train(model, opt, 3, seed=1)
        opt.param_groups[0]["lr"] = 5e-3
        aux_opt.step()  # no grads yet: creates no state
        aux(torch.randn(2, 5)).sum().backward()
        aux_opt.step()
        sampler.record_batch(0, 4)
    elif rank == 1:
        _train(model, opt, 1, seed=2)
    # rank 2 never stepped: EMPTY optimizer state, as a newly joined peer
    return state


def _dump(state: TorchState) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": state.model.state_dict(),
            "opt": state.optimizer.state_dict(),
            "aux": state.aux.state_dict(),
            "aux_opt": state.aux_opt.state_dict(),
            "sampler": state.sampler.state_dict(),
            "metric": state.metric.clone(),
            "epoch": state.epoch,
            "meta": [state.meta["rank"], list(state.meta["tags"]), list(state.meta["raw"])],
        }
    )


_PAYLOAD_LENGTHS = (0, 1, 7, 8, 9, 300)


def _payload(rank: int, n: int) -> bytes:
    return bytes((rank * 37 + i * 11 + 200) % 256 for i in range(n))


def _sync_worker(rank: int, world: int, outdir: Path) -> None:
    out: dict[str, Any] = {}
    state = _build_state(rank)
    if rank == 2:
        assert len(state.optimizer.state) == 0 and len(state.aux_opt.state) == 0
    state.sync()
    out["synced"] = _dump(state)
    _train(state.model, state.optimizer, 2, seed=7)  # same data everywhere: stays identical
    out["trained"] = _dump(state)

    # Bucketing edge cases: mixed dtypes, a tensor bigger than a bucket, a non-contiguous view,
    # an empty tensor, with tiny bucket and split sizes so many buckets are in flight.
    gen = torch.Generator().manual_seed(rank)
    big = torch.randn(3000, generator=gen)
    base = torch.randn(8, 6, generator=gen)
    tensors = [
        torch.randn(10, generator=gen),
        big,
        base.t(),
        torch.empty(0),
        torch.arange(50) * (rank + 1),
        torch.rand(33, generator=gen) > 0.5,
        torch.randn(7, generator=gen).double(),
    ]
    broadcast_tensors(tensors, bucket_bytes=256, split_bytes=100)  # most buckets go as halves
    out["buckets"] = [t.clone() for t in tensors]

    # The source's payload inside the layout check and past it, from a source that is not
    # rank 0, ending at every place the inline part can end. Each rank offers its own bytes:
    # only the source's may arrive.
    with syncing_from(1):
        # Plain bytes ride in the same header: inside it, empty, and past its 16 KiB.
        out["bytes"] = [broadcast_bytes(_payload(rank, n)).hex() for n in (0, 9, 20_000)]
        out["validated"] = [
            broadcast_validated(_payload(rank, n), start_layout_check("same layout", "test"),
                                "test", inline=8).hex()
            for n in _PAYLOAD_LENGTHS
        ]

    # A rank with another model shape: every rank raises, nobody hangs.
    odd = TorchState(_net(hidden=16 if rank != 1 else 15))
    try:
        odd.sync()
    except ValueError as exc:
        out["layout_error"] = "differs" in str(exc)
    # An unsupported plain value: TypeError everywhere; the source's names the value, the
    # others say the source could not send (only the source encodes). Then a value only
    # the source (rank 2) holds: the same, and nobody waits for the others.
    try:
        TorchState(_net(), bad={1, 2}).sync()
    except SourceCannotSend:
        out["type_error"] = rank != 0
    except TypeError as exc:
        out["type_error"] = rank == 0 and "bad" in str(exc) and "set" in str(exc)
    with syncing_from(2):
        try:
            TorchState(_net(), bad={1, 2} if rank == 2 else 0).sync()
        except SourceCannotSend:
            out["type_error"] &= rank != 2
        except TypeError as exc:
            out["type_error"] &= rank == 2 and "bad" in str(exc)
    ok = torch.ones(1)
    dist.all_reduce(ok)
    out["group_ok"] = float(ok) == world
    torch.save(out, outdir / f"rank{rank}.pt")


@pytest.mark.slow
def test_sync_makes_every_rank_bit_identical(tmp_path: Path) -> None:
    _run_world(_sync_worker, 3, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    ref = results[0]
    assert ref["synced"]["epoch"] == 0 and ref["synced"]["meta"] == [0, ["a", 0], [0]]
    assert len(ref["synced"]["opt"]["state"]) == 6 and len(ref["synced"]["aux_opt"]["state"]) == 2
    assert ref["synced"]["opt"]["param_groups"][0]["lr"] == 5e-3
    assert ref["validated"] == [_payload(1, n).hex() for n in _PAYLOAD_LENGTHS]
    assert ref["bytes"] == [_payload(1, n).hex() for n in (0, 9, 20_000)]
    for rank, res in enumerate(results[1:], start=1):
        assert res["validated"] == ref["validated"] and res["bytes"] == ref["bytes"]
        for key in ("synced", "trained", "buckets"):
            _assert_same(res[key], ref[key], f"rank{rank}.{key}")
        assert res["layout_error"] and res["type_error"] and res["group_ok"]
    assert ref["layout_error"] and ref["type_error"] and ref["group_ok"]


# --- striped sync: several holders of the newest state send one shard each -----------------------


def _striped_worker(rank: int, world: int, outdir: Path) -> None:
    from peer_elastic.state.agreement import Claim, StateVersion
    from peer_elastic.state.sync import agree_and_sync

    out: dict[str, Any] = {}
    holder = rank < 3  # ranks 0-2 survived with one state; rank 3 joined with its own
    state = _build_state(0 if holder else 3)
    newest = StateVersion(1, 4, 2, 7)
    claim = Claim(newest if holder else StateVersion(), needs_state=not holder)
    if holder:
        state.save()  # the survivors' last commit is the newest version: no save after sync
    saved = state._handlers["model"]._buffers.data_ptrs()  # noqa: SLF001 - restore point
    agreement = agree_and_sync(state, claim, torch.device("cpu"),
                               committed=claim.version if holder else StateVersion())
    out["source"] = agreement.source
    out["synced"] = _dump(state)
    with torch.no_grad():  # the restore point must be the synced state
        for p in state.model.parameters():
            p.add_(1.0)
    state.restore()
    out["restored"] = _dump(state)
    out["same_buffers"] = saved == state._handlers["model"]._buffers.data_ptrs()  # noqa: SLF001

    # Edge cases of the shards: mixed dtypes, a 1-element tensor (two empty shards), an empty
    # tensor, a non-contiguous view, tiny buckets; holders 1 and 2 (source 1) send to 0 and 3.
    gen = torch.Generator().manual_seed(0 if rank in (1, 2) else rank + 10)
    base = torch.randn(9, 7, generator=gen)
    tensors = [torch.randn(1, generator=gen), torch.randn(3001, generator=gen), base.t(),
               torch.empty(0), torch.arange(50) * (1 if rank in (1, 2) else rank + 5),
               torch.rand(33, generator=gen) > 0.5, torch.randn(7, generator=gen).double()]
    with syncing_from(1, holders=(1, 2)):
        broadcast_tensors(tensors, bucket_bytes=256, direct_bytes=1024)
    out["shards"] = [t.clone() for t in tensors]
    torch.save(out, outdir / f"rank{rank}.pt")


@pytest.mark.slow
def test_striped_join_leaves_every_rank_bit_identical(tmp_path: Path) -> None:
    _run_world(_striped_worker, 4, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    ref = results[0]
    assert ref["source"] == 0 and ref["synced"]["epoch"] == 0
    assert ref["synced"]["opt"]["param_groups"][0]["lr"] == 5e-3  # rank 0's build, trained
    for rank, res in enumerate(results):
        for key in ("synced", "restored", "shards"):
            _assert_same(res[key], ref[key], f"rank{rank}.{key}")
        _assert_same(res["restored"], res["synced"], f"rank{rank} restore point")
        assert res["same_buffers"]


def test_a_large_packed_bucket_is_cut_at_the_tensor_boundary_nearest_its_middle() -> None:
    def sized(*numels: int) -> list[torch.Tensor]:
        return [torch.empty(n) for n in numels]  # 4 bytes each

    bucket = sized(10, 30, 5, 5, 50)  # 400 bytes; the middle byte falls after the 4th
    assert [[t.numel() for t in h] for h in halves(bucket, split=400)] == [[10, 30, 5, 5], [50]]
    assert halves(bucket, split=401) == [bucket]  # too small to be worth a second collective
    one = sized(1000)
    assert halves(one, split=4) == [one]  # a single tensor is never cut
    assert [[t.numel() for t in h] for h in halves(sized(1, 1), split=1)] == [[1], [1]]


def test_syncing_from_requires_the_source_among_the_holders() -> None:
    from peer_elastic.torch.transport.buckets import shard_bounds
    from peer_elastic.torch.transport.sync_source import sync_holders, syncing_from

    with pytest.raises(ValueError, match="not among the holders"):
        with syncing_from(2, holders=(0, 1)):
            pass
    with syncing_from(1, holders=(2, 1, 1)):
        assert sync_holders() == (1, 2)
    assert sync_holders() == ()
    assert shard_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert shard_bounds(1, 3) == [(0, 0), (0, 0), (0, 1)]


def test_a_handler_with_its_own_sync_is_not_bypassed_by_an_inherited_description() -> None:
    from peer_elastic.state.handlers import describe_for_sync

    class OwnSync(ModuleHandler):
        def sync(self) -> None:  # pragma: no cover - never called here
            pass

    net = _net()
    assert describe_for_sync(OwnSync(net)) is None
    described = describe_for_sync(ModuleHandler(net))
    assert described is not None and len(described.tensors) == len(net.state_dict())
    assert describe_for_sync(make_handler(ElasticSampler(range(4)))) is None
