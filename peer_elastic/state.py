"""Training state that survives membership changes: commit, restore and sync (Horovod Elastic).

``State.commit()`` saves a copy in memory and checks for a pending membership change;
``restore()`` returns to the last commit after a failed collective; ``sync()`` makes every
rank hold the sync source's state (rank 0 unless the run loop chose another) after a new
process group is formed.

Why it is shaped this way:

* ``commit`` runs every few batches, so it copies tensors into buffers it keeps (allocated
  once, ``copy_`` afterwards) instead of ``deepcopy``/pickle per commit.
* ``sync`` runs after resets, when everybody waits for it, so it sends tensors in large flat
  buckets (one ``dist.broadcast`` each, pipelined) instead of one pickled object per tensor.
* Anything received from another peer is untrusted input: plain values travel as tagged JSON,
  never pickle. Types the codec does not know need a registered handler.

How the elastic run loop (``peer_elastic.elastic.Peer``) uses a state::

    state.attach(checker)          # commit() and check_host_updates() go through it
    while True:
        <form the new process group>
        state.on_reset()           # handlers' reset (samplers re-partition), then callbacks
        <agree on the newest state version; sync from a rank holding it if ranks differ>
        try:
            return train(state)    # calls state.commit() every few batches
        except HostsUpdatedInterrupt:
            pass                   # keep live state (progress was merged first)
        except <a collective failed>:
            state.restore()

The checker makes a commit safe under failures: it first agrees with the other ranks (one
all-reduce), merges progress some rank recorded only locally (``record_indices``), and only
then calls ``record_commit()`` (save and count); see ``peer_elastic.agreement``.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.sampler import (
    ElasticSampler,
    _collective_inplace,
    _staging_device,
    _world_from_dist,
    sync_source,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_BYTES",
    "HandlerFactory",
    "LRSchedulerHandler",
    "ModuleHandler",
    "ObjectState",
    "OptimizerHandler",
    "SamplerHandler",
    "State",
    "StateHandler",
    "TensorHandler",
    "TorchState",
    "broadcast_plain",
    "broadcast_tensors",
    "decode_values",
    "encode_values",
    "make_handler",
    "register_handler",
    "unregister_handler",
]

DEFAULT_BUCKET_BYTES = 64 * 2**20
"""Bytes per flat bucket in ``broadcast_tensors``: large enough that per-call latency is
negligible, small enough that two buckets in flight cost little memory."""

DEFAULT_DIRECT_BYTES = 4 * 2**20
"""Tensors at least this large are broadcast in place, each in its own collective: at this
size the per-call latency is already small, while flattening would cost two copies and the
page faults of a fresh staging buffer (measured: slower than the broadcast itself)."""

_MAX_IN_FLIGHT = 2

# ======================================================================================
# Plain-value codec: tagged JSON, never pickle
# ======================================================================================

_TAG_TUPLE, _TAG_BYTES, _TAG_DICT = "t", "b", "d"
_PLAIN_TYPES = "None, bool, int, float, str, bytes, and lists/tuples/dicts of those"


def _encode(value: Any, path: str) -> Any:
    """One value to a JSON-able tree. Containers become tagged objects so that tuples, bytes
    and non-string dict keys survive; JSON objects only ever appear as tags."""
    if value is None:
        return None
    if isinstance(value, str):
        return str.__str__(value)  # the characters, also for str enums
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, bytes):
        return {_TAG_BYTES: base64.b64encode(value).decode("ascii")}
    if type(value) is list:
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {_TAG_TUPLE: [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        return {
            _TAG_DICT: [
                [_encode(k, f"{path} key"), _encode(v, f"{path}[{k!r}]")] for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which sync() cannot "
        f"send without pickle. Keep plain values ({_PLAIN_TYPES}) in the state, or register a "
        f"handler for this type with peer_elastic.state.register_handler(type, factory) and "
        f"pass the object to TorchState."
    )


def _decode(obj: Any) -> Any:
    """Inverse of ``_encode``; raises ValueError on anything ``_encode`` cannot produce."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        ((tag, payload),) = obj.items()
        if tag == _TAG_TUPLE and isinstance(payload, list):
            return tuple(_decode(v) for v in payload)
        if tag == _TAG_BYTES and isinstance(payload, str):
            return base64.b64decode(payload, validate=True)
        if tag == _TAG_DICT and isinstance(payload, list):
            try:
                return {_decode(k): _decode(v) for k, v in payload}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"malformed dict in state payload: {exc}") from None
    raise ValueError(f"malformed state payload: unexpected {type(obj).__name__}")


def encode_values(values: Mapping[str, Any], where: str = "state") -> bytes:
    """Encode named plain values to bytes (UTF-8 JSON). TypeError names the offending path."""
    tree = {name: _encode(value, f"{where}.{name}") for name, value in values.items()}
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_values(data: bytes) -> dict[str, Any]:
    """Decode ``encode_values`` output (safe on untrusted bytes: JSON only)."""
    tree = json.loads(data.decode("utf-8"))
    if not isinstance(tree, dict):
        raise ValueError("malformed state payload: top level is not an object")
    return {str(name): _decode(value) for name, value in tree.items()}


def _copy_plain(value: Any) -> Any:
    """Snapshot of a plain value: containers deep (they are small), anything else shallow."""
    if isinstance(value, (list, tuple, dict, set)):
        return copy.deepcopy(value)
    return copy.copy(value)


# ======================================================================================
# Collectives
# ======================================================================================


def _world_size() -> int:
    return _world_from_dist()[1]


def _broadcast_bytes(payload: bytes) -> bytes:
    """The sync source's ``payload`` on every rank: length, then the bytes (two broadcasts)."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    _collective_inplace(length, "broadcast")
    n = int(length.item())
    if n == 0:
        return b""
    if dist.get_rank() == sync_source():
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    _collective_inplace(buf, "broadcast")
    return buf.numpy().tobytes()


def broadcast_plain(value: Any, what: str = "value") -> Any:
    """Rank 0's plain ``value`` on every rank, without pickle (for custom handlers).

    Every rank encodes its own value first, so an unsupported type raises TypeError on all
    ranks alike instead of leaving the others waiting in the broadcast.
    """
    payload = encode_values({"v": value}, where=what)
    if _world_size() <= 1:
        return value
    return decode_values(_broadcast_bytes(payload))["v"]


def _agree(description: str, what: str) -> None:
    """Raise ValueError on EVERY rank unless all ranks have the same ``description``.

    A mismatched structure would otherwise make the bucketed broadcasts disagree on sizes
    and hang or corrupt memory; comparing a digest costs two tiny collectives.
    """
    digest = hashlib.sha256(description.encode("utf-8")).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    root = mine.clone()
    _collective_inplace(root, "broadcast")
    differs_here = not torch.equal(root, mine)
    flag = torch.tensor([int(differs_here)], dtype=torch.uint8)
    _collective_inplace(flag, "all_reduce")
    if flag.item():
        where = "this rank differs from rank 0" if differs_here else "another rank differs"
        raise ValueError(
            f"{what} differs between ranks ({where}); every peer must build the same models, "
            f"optimizers and state attributes. This rank's layout begins: {description[:300]!r}"
        )


@dataclass
class _Transfer:
    bucket: list[torch.Tensor]
    wire: torch.Tensor
    work: Any
    direct: bool


def _plan_buckets(
    tensors: Sequence[torch.Tensor], cap: int, direct: int
) -> list[list[torch.Tensor]]:
    """Group by (dtype, device) in first-seen order; tensors of ``direct`` bytes or more get
    a bucket of their own, the others are packed into buckets of at most ``cap`` bytes.

    Depends only on sizes, dtypes and devices (never on memory layout), so every rank plans
    the same buckets.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in groups.values():
        current: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if nbytes >= direct:
                buckets.append([t])
                continue
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(t)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def _start_bucket(
    bucket: list[torch.Tensor], is_src: bool, src: int, stage: torch.device | None
) -> _Transfer:
    """Flatten (on the source) and launch an async broadcast of one bucket."""
    first = bucket[0]
    needs_stage = stage is not None and first.device.type == "cpu"
    if len(bucket) == 1 and first.is_contiguous() and not needs_stage:
        wire, direct = first, True  # broadcast in place, no copies
    else:
        device = stage if needs_stage else first.device
        if is_src:
            wire = torch.cat([t.reshape(-1) for t in bucket]).to(device)
        else:
            wire = torch.empty(sum(t.numel() for t in bucket), dtype=first.dtype, device=device)
        direct = False
    work = dist.broadcast(wire, src=src, async_op=True)
    return _Transfer(bucket, wire, work, direct)


def _finish_bucket(transfer: _Transfer, is_src: bool) -> None:
    """Wait for one bucket and (on receivers) scatter it back into its tensors."""
    transfer.work.wait()
    if is_src or transfer.direct:
        return
    bucket = transfer.bucket
    flat = transfer.wire.to(bucket[0].device)
    pieces = flat.split([t.numel() for t in bucket])
    _copy_all(bucket, [p.view(t.shape) for p, t in zip(pieces, bucket, strict=True)])


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s (default: the sync source), in place.

    Small tensors travel packed in flat buckets (one ``dist.broadcast`` per bucket), large
    ones in place; two collectives are in flight at once, so packing the next bucket overlaps
    the current broadcast. Every rank must pass tensors with the same dtypes, device kinds and
    sizes, in the same order. A no-op without a process group or with world size 1.
    """
    if _world_size() <= 1:
        return
    src = sync_source() if src is None else src
    is_src = dist.get_rank() == src
    stage = _staging_device()
    in_flight: deque[_Transfer] = deque()
    for bucket in _plan_buckets(tensors, bucket_bytes, direct_bytes):
        in_flight.append(_start_bucket(bucket, is_src, src, stage))
        if len(in_flight) >= _MAX_IN_FLIGHT:
            _finish_bucket(in_flight.popleft(), is_src)
    while in_flight:
        _finish_bucket(in_flight.popleft(), is_src)


# ======================================================================================
# Tensor snapshots
# ======================================================================================


def _copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one dispatch when torch has ``_foreach_copy_``."""
    if not dsts:
        return
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(list(dsts), list(srcs))
        else:  # pragma: no cover - older torch
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class _Buffers:
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
            if buf is None or not _same_meta(buf, live):
                buf = torch.empty(live.shape, dtype=live.dtype, device=live.device)
            store[key] = buf
            dsts.append(buf)
            srcs.append(live)
        self._store = store
        _copy_all(dsts, srcs)

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        return self._store[key]

    def data_ptrs(self) -> list[int]:
        """Addresses of the buffers (lets tests check that commits do not reallocate)."""
        return [t.data_ptr() for t in self._store.values()]


# ======================================================================================
# State, ObjectState
# ======================================================================================

HostChecker = Callable[["State", bool], None]
"""What ``commit()`` (``committing=True``) and ``check_host_updates()`` call once a run loop
attached one: ``checker(state, committing)``. It may raise HostsUpdatedInterrupt; when
committing it calls ``state.record_commit()`` once the ranks agreed."""


class State:
    """Everything that must agree across ranks; base of ObjectState and TorchState.

    ``commit()`` saves the state in memory and checks for membership changes. The elastic
    loop attaches a checker with :meth:`attach`; without one (e.g. plain single-process
    runs) the check is a no-op and a commit just saves.
    """

    def __init__(self) -> None:
        self._checker: HostChecker | None = None
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commit_count = 0
        self.last_commit_time: float | None = None

    def attach(self, checker: HostChecker | None) -> None:
        """Route ``commit()`` and ``check_host_updates()`` through ``checker`` (None
        detaches). The elastic run loop attaches one for the duration of ``Peer.run``."""
        self._checker = checker

    def commit(self) -> None:
        """Save in memory, then check for membership changes (which may raise).

        Under the run loop, the save happens after the ranks agreed in the check's
        collective and merged any locally recorded progress, so a commit either exists on a
        rank with every rank's progress in it, or not at all.
        """
        if self._checker is None:
            self.record_commit()
        else:
            self._checker(self, True)

    def record_commit(self) -> None:
        """Save and count one commit: the local half of ``commit()``."""
        self.save()
        self.commit_count += 1
        self.last_commit_time = time.time()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt (through the attached checker) if a reset is pending."""
        if self._checker is not None:
            self._checker(self, False)

    def has_local_progress(self) -> bool:
        """True while this rank holds progress the other ranks do not know yet (samples
        marked with ``record_indices`` or ``record_all_ranks=False`` since the last merge)."""
        return False

    def merge_progress(self) -> None:
        """Collective: merge every rank's locally recorded progress. Every rank calls it when
        any rank has local progress (the run loop decides that in one all-reduce)."""

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Add zero-argument callables run by ``on_reset`` in registration order (e.g. to
        rescale the learning rate to the new world size)."""
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"reset callback {cb!r} is not callable")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by the run loop on every rank each time a process group forms (the first
        one and joiners' included), before ``sync``: ``reset()`` then the reset callbacks.
        Callbacks may run collectives (e.g. rebuild DDP): every rank enters them together."""
        self.reset()
        for cb in list(self._reset_callbacks):
            cb()

    def reset(self) -> None:
        """Local re-initialisation after membership changed. Default: nothing."""

    def save(self) -> None:
        """Copy the live state into memory (the restore point)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Return the live state to the last ``save``."""
        raise NotImplementedError

    def sync(self) -> None:
        """Collective: make every rank's live state equal to the sync source's (rank 0
        unless the run loop chose the rank holding the newest state)."""
        raise NotImplementedError


def _check_names(cls: type, names: Iterable[str]) -> None:
    """Attribute names must not shadow the State API or its private fields."""
    bad = [
        n
        for n in names
        if n.startswith("_") or hasattr(cls, n) or n in ("commit_count", "last_commit_time")
    ]
    if bad:
        raise ValueError(f"state attribute names {bad} are reserved by {cls.__name__}")


class ObjectState(State):
    """Plain Python values (epoch, batch, ...) exposed as attributes.

    ``save`` snapshots them (containers deep-copied, they are small), ``restore`` puts the
    snapshot back, ``sync`` sends rank 0's values as tagged JSON: only plain values
    (None, bool, int, float, str, bytes, and lists/tuples/dicts of those) are accepted.
    """

    def __init__(self, **kwargs: Any) -> None:
        _check_names(type(self), kwargs)
        super().__init__()
        self._names: list[str] = list(kwargs)
        self._saved: dict[str, Any] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        ObjectState.save(self)

    def save(self) -> None:
        self._saved = {name: _copy_plain(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name in self._names:
            setattr(self, name, _copy_plain(self._saved[name]))

    def sync(self) -> None:
        """Rank 0's values on every rank (all ranks end with the decoded values, so types
        such as numpy scalars become the same builtins everywhere)."""
        payload = encode_values(
            {name: getattr(self, name) for name in self._names}, where=type(self).__name__
        )
        if _world_size() <= 1:
            return
        values = decode_values(_broadcast_bytes(payload))
        if set(values) != set(self._names):
            raise ValueError(
                f"state attributes differ from rank 0: {sorted(values)} vs {sorted(self._names)}"
            )
        for name in self._names:
            setattr(self, name, values[name])


# ======================================================================================
# Handlers
# ======================================================================================


class StateHandler:
    """Saves, restores and broadcasts one object held by a TorchState.

    Subclass it for your own types and ``register_handler(YourType, YourHandler)``. Use
    ``broadcast_tensors`` and ``broadcast_plain`` in ``sync`` so nothing is pickled.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Local work after membership changed (before sync). Default: nothing."""

    def has_local_progress(self) -> bool:
        """True while this object holds progress recorded on this rank only."""
        return False

    def merge_progress(self) -> None:
        """Collective: merge locally recorded progress of every rank. Default: nothing."""

    def layout(self) -> str:
        """Structure that must be identical on every rank for ``sync`` to work; checked with
        one digest before any handler syncs."""
        return f"{type(self.value).__module__}.{type(self.value).__qualname__}"


class TensorHandler(StateHandler):
    """A tensor kept in the state (e.g. a running metric): copied, not rebound."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self._buffers = _Buffers()
        self.save()

    def save(self) -> None:
        self._buffers.capture([(0, self.value)])

    def restore(self) -> None:
        saved = self._buffers[0]
        if not _same_meta(saved, self.value):
            raise RuntimeError("tensor changed shape/dtype since the last commit")
        _copy_all([self.value.detach()], [saved])

    def sync(self) -> None:
        broadcast_tensors([self.value.detach()])

    def layout(self) -> str:
        value = self.value
        return f"Tensor:{value.dtype}:{tuple(value.shape)}:{value.device.type}"


class ModuleHandler(StateHandler):
    """An ``nn.Module``: every tensor of its ``state_dict`` (parameters and buffers).

    save: ``copy_`` into kept buffers. restore: ``copy_`` back under ``no_grad``.
    sync: ``broadcast_tensors`` of the live tensors (``state_dict`` tensors alias them).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._buffers = _Buffers()
        self._saved_names: list[str] = []
        self.save()

    def _live(self) -> list[tuple[str, torch.Tensor]]:
        """The module's state tensors, each memory region once (tied weights appear under
        several names in ``state_dict``; copying or sending them twice is wasted work)."""
        items = []
        seen: set[tuple] = set()
        for name, value in self.value.state_dict().items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{type(self.value).__name__} state entry {name!r} is a "
                    f"{type(value).__name__}, not a tensor; register a handler for this module "
                    "type with peer_elastic.state.register_handler"
                )
            alias = (value.data_ptr(), value.dtype, value.device, value.shape, value.stride())
            if value.numel() and alias in seen:
                continue
            seen.add(alias)
            items.append((name, value))
        return items

    def save(self) -> None:
        items = self._live()
        self._buffers.capture(items)
        self._saved_names = [name for name, _ in items]

    def restore(self) -> None:
        items = self._live()
        if [name for name, _ in items] != self._saved_names or not all(
            _same_meta(t, self._buffers[name]) for name, t in items
        ):
            raise RuntimeError(
                "module structure changed since the last commit; commit after changing it"
            )
        _copy_all([t for _, t in items], [self._buffers[name] for name, _ in items])

    def sync(self) -> None:
        broadcast_tensors([t for _, t in self._live()])

    def layout(self) -> str:
        return "\n".join(f"{n}:{t.dtype}:{tuple(t.shape)}:{t.device.type}" for n, t in self._live())


class _Entry(NamedTuple):
    """Saved form of one dict of optimizer state or one param group."""

    tensor_keys: tuple[Any, ...]
    plain: dict[Any, Any]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"malformed optimizer description: unknown dtype {name!r}")
    return dtype


def _slot(
    current: Any, dtype: torch.dtype, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """``current`` if it already has the wanted metadata, else a fresh tensor to receive into."""
    if (
        isinstance(current, torch.Tensor)
        and current.dtype == dtype
        and tuple(current.shape) == tuple(shape)
        and current.device == device
    ):
        return current
    return torch.empty(tuple(shape), dtype=dtype, device=device)


class OptimizerHandler(StateHandler):
    """A ``torch.optim.Optimizer``: per-parameter state (momentum, exp_avg, step...) and the
    param groups' hyper-parameters.

    save/restore copy tensors into/out of kept buffers and snapshot plain values; restore
    also re-creates state entries created after the save and deletes ones that did not
    exist then. sync first broadcasts a JSON description of rank 0's state (which params
    have state, each tensor's key/dtype/shape, the plain values), so a rank whose optimizer
    never stepped allocates matching tensors; then all tensors go in flat buckets.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._buffers = _Buffers()
        self._saved_sizes: list[int] = []
        self._saved_groups: list[_Entry] = []
        self._saved_state: list[_Entry | None] = []
        self.save()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.value.param_groups for p in group["params"]]

    def _group_sizes(self) -> list[int]:
        return [len(group["params"]) for group in self.value.param_groups]

    # --- save / restore -------------------------------------------------------------------

    @staticmethod
    def _split(mapping: Mapping[Any, Any], prefix: tuple[Any, ...], items: list) -> _Entry:
        tensor_keys, plain = [], {}
        for key, value in mapping.items():
            if key == "params" and prefix[0] == "g":
                continue
            if isinstance(value, torch.Tensor):
                tensor_keys.append(key)
                items.append(((*prefix, key), value))
            else:
                plain[key] = _copy_plain(value)
        return _Entry(tuple(tensor_keys), plain)

    def save(self) -> None:
        items: list[tuple[Hashable, torch.Tensor]] = []
        opt = self.value
        groups = [self._split(g, ("g", i), items) for i, g in enumerate(opt.param_groups)]
        states: list[_Entry | None] = []
        for i, p in enumerate(self._params()):
            st = opt.state.get(p)
            states.append(None if st is None else self._split(st, ("s", i), items))
        self._buffers.capture(items)
        self._saved_sizes = self._group_sizes()
        self._saved_groups, self._saved_state = groups, states

    def _apply(self, live: dict, entry: _Entry, prefix: tuple, pairs: list, prune: bool) -> None:
        """Put one saved entry back into ``live`` (copies are queued in ``pairs``)."""
        for key in entry.tensor_keys:
            saved = self._buffers[(*prefix, key)]
            current = live.get(key)
            if isinstance(current, torch.Tensor) and _same_meta(current, saved):
                pairs.append((current, saved))
            else:
                live[key] = saved.clone()
        for key, value in entry.plain.items():
            live[key] = _copy_plain(value)
        if prune:
            keep = set(entry.tensor_keys) | set(entry.plain)
            for key in [k for k in live if k not in keep]:
                del live[key]

    def restore(self) -> None:
        opt = self.value
        if self._group_sizes() != self._saved_sizes:
            raise RuntimeError(
                "optimizer param groups changed since the last commit; commit after add_param_group"
            )
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, group in enumerate(opt.param_groups):
            self._apply(group, self._saved_groups[i], ("g", i), pairs, prune=False)
        for i, p in enumerate(self._params()):
            entry = self._saved_state[i]
            if entry is None:
                opt.state.pop(p, None)
            else:
                self._apply(opt.state[p], entry, ("s", i), pairs, prune=True)
        _copy_all([d for d, _ in pairs], [s for _, s in pairs])

    # --- sync ---------------------------------------------------------------------------------

    @staticmethod
    def _describe_mapping(mapping: Mapping[Any, Any], tensors: list, skip: str | None) -> list:
        plain, specs = {}, []
        for key, value in mapping.items():
            if key == skip:
                continue
            if isinstance(value, torch.Tensor):
                specs.append(
                    [key, _dtype_name(value.dtype), list(value.shape), value.device.type == "cpu"]
                )
                tensors.append(value.detach())
            else:
                plain[key] = value
        return [plain, specs]

    def _describe(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Pickle-free description of the live state, and its tensors in description order."""
        opt = self.value
        tensors: list[torch.Tensor] = []
        groups = [self._describe_mapping(g, tensors, "params") for g in opt.param_groups]
        state = []
        for p in self._params():
            st = opt.state.get(p)
            state.append(None if st is None else self._describe_mapping(st, tensors, None))
        return {"groups": groups, "state": state}, tensors

    @staticmethod
    def _materialize_mapping(
        live: dict, desc: Any, device: torch.device, tensors: list, prune: bool
    ) -> None:
        plain, specs = desc
        if prune:
            keep = set(plain) | {spec[0] for spec in specs}
            for key in [k for k in live if k not in keep]:
                del live[key]
        live.update(plain)
        for key, dtype, shape, on_cpu in specs:
            target = torch.device("cpu") if on_cpu else device
            live[key] = _slot(live.get(key), _parse_dtype(dtype), shape, target)
            tensors.append(live[key])

    def _materialize(self, desc: dict[str, Any]) -> list[torch.Tensor]:
        """Make this optimizer's structure match rank 0's description; return the tensors to
        receive into, in description order."""
        opt = self.value
        params = self._params()
        groups, state = desc["groups"], desc["state"]
        if len(groups) != len(opt.param_groups) or len(state) != len(params):
            raise ValueError("optimizer param groups differ from rank 0")
        tensors: list[torch.Tensor] = []
        for group, group_desc in zip(opt.param_groups, groups, strict=True):
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            self._materialize_mapping(group, group_desc, device, tensors, prune=False)
        for p, entry in zip(params, state, strict=True):
            if entry is None:
                opt.state.pop(p, None)
            else:
                self._materialize_mapping(opt.state[p], entry, p.device, tensors, prune=True)
        return tensors

    def sync(self) -> None:
        if _world_size() <= 1:
            return
        desc, tensors = self._describe()
        payload = encode_values({"optimizer": desc}, where=type(self.value).__name__)
        received = decode_values(_broadcast_bytes(payload))["optimizer"]
        if dist.get_rank() != sync_source():
            tensors = self._materialize(received)
        broadcast_tensors(tensors)

    def layout(self) -> str:
        shapes = [[tuple(p.shape) for p in g["params"]] for g in self.value.param_groups]
        return f"{type(self.value).__qualname__}:{shapes}"


class LRSchedulerHandler(StateHandler):
    """A learning-rate scheduler: its ``state_dict`` is plain values, sent as tagged JSON."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        state = broadcast_plain(self.value.state_dict(), what=type(self.value).__name__)
        self.value.load_state_dict(state)


class SamplerHandler(StateHandler):
    """An ``ElasticSampler``: its own ``state_dict``/``load_state_dict`` and ``sync``."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self.save()

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.sync()

    def reset(self) -> None:
        self.value.reset()

    def has_local_progress(self) -> bool:
        return self.value.has_local_progress

    def merge_progress(self) -> None:
        self.value.merge()

    def layout(self) -> str:
        return f"ElasticSampler:{len(self.value.dataset)}"


# ======================================================================================
# Handler registry
# ======================================================================================

HandlerFactory = Callable[[Any], StateHandler]

_user_handlers: list[tuple[type, HandlerFactory]] = []

_BUILTIN_HANDLERS: tuple[tuple[type, HandlerFactory], ...] = (
    (nn.Module, ModuleHandler),
    (torch.optim.Optimizer, OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerHandler),
    (ElasticSampler, SamplerHandler),
    (torch.Tensor, TensorHandler),
)


def register_handler(type_: type, factory: HandlerFactory) -> None:
    """Let TorchState manage values of ``type_`` (isinstance match) with ``factory(value)``.

    User registrations are consulted before the built-in ones, in registration order;
    registering the same type again replaces its factory in place.
    """
    if not isinstance(type_, type):
        raise TypeError(f"register_handler needs a type, got {type_!r}")
    if not callable(factory):
        raise TypeError(f"handler factory {factory!r} is not callable")
    for i, (registered, _) in enumerate(_user_handlers):
        if registered is type_:
            _user_handlers[i] = (type_, factory)
            return
    _user_handlers.append((type_, factory))


def unregister_handler(type_: type) -> bool:
    """Remove a user registration; returns whether one existed."""
    for i, (registered, _) in enumerate(_user_handlers):
        if registered is type_:
            del _user_handlers[i]
            return True
    return False


def make_handler(value: Any) -> StateHandler | None:
    """The handler for ``value`` (first isinstance match), or None for a plain value."""
    for type_, factory in (*_user_handlers, *_BUILTIN_HANDLERS):
        if isinstance(value, type_):
            handler = factory(value)
            if not isinstance(handler, StateHandler):
                raise TypeError(f"handler factory for {type_.__name__} returned {handler!r}")
            return handler
    return None


# ======================================================================================
# TorchState
# ======================================================================================


class TorchState(ObjectState):
    """State of a PyTorch training process (``horovod.torch.elastic.TorchState``).

    Keyword values with a handler (``nn.Module``, ``Optimizer``, LR scheduler,
    ``ElasticSampler``, ``Tensor``, or a registered type) are managed by it; the rest are
    plain ObjectState values. Attributes return the live objects (``state.model`` is the
    module). ``sync`` checks that all ranks have the same layout, then syncs handlers in
    sorted attribute-name order, then the plain values.
    """

    register_handler = staticmethod(register_handler)

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        values = {"model": model, "optimizer": optimizer, **kwargs}
        _check_names(type(self), values)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in values.items():
            handler = make_handler(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handler = make_handler(value)
            if handler is None:
                raise TypeError(
                    f"state.{name} is managed by {type(handlers[name]).__name__}; cannot "
                    f"replace it with a {type(value).__name__} that has no handler"
                )
            handlers[name] = handler
        super().__setattr__(name, value)

    def _ordered_handlers(self) -> list[StateHandler]:
        return [self._handlers[name] for name in sorted(self._handlers)]

    def _layout(self) -> str:
        parts = [f"{n}={type(h).__name__}[{h.layout()}]" for n, h in sorted(self._handlers.items())]
        return "\n".join([*parts, "plain=" + ",".join(sorted(self._names))])

    def save(self) -> None:
        for handler in self._ordered_handlers():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._ordered_handlers():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        if _world_size() <= 1:
            super().sync()  # still validates that plain values are sendable
            return
        _agree(self._layout(), "TorchState layout")
        for handler in self._ordered_handlers():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._ordered_handlers():
            handler.reset()

    def has_local_progress(self) -> bool:
        return any(h.has_local_progress() for h in self._handlers.values())

    def merge_progress(self) -> None:
        # Every handler, in a fixed order: the collectives must match on every rank, also on
        # a rank whose own sampler recorded nothing.
        for handler in self._ordered_handlers():
            handler.merge_progress()
