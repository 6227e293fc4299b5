"""How a TorchState saves, restores and syncs each kind of object it holds.

One :class:`StateHandler` per object: modules, optimizers, LR schedulers, samplers and
tensors have built-in handlers; ``register_handler(type, factory)`` adds one for a user type
(consulted first, in registration order). Handlers sync with the collectives of
:mod:`peer_elastic.torch.transport.collectives`, so nothing is pickled.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.state.codec import copy_plain, decode_values, encode_values
from peer_elastic.state.sampler import ElasticSampler
from peer_elastic.torch.transport.collectives import (
    broadcast_bytes,
    broadcast_plain,
    broadcast_tensors,
    world_size,
)
from peer_elastic.torch.transport.snapshots import Buffers, copy_all, same_meta
from peer_elastic.torch.transport.sync_source import sync_source

__all__ = [
    "HandlerFactory",
    "SyncDescription",
    "LRSchedulerHandler",
    "ModuleHandler",
    "OptimizerHandler",
    "SamplerHandler",
    "StateHandler",
    "TensorHandler",
    "describe_for_sync",
    "make_handler",
    "register_handler",
    "registered_handlers",
    "unregister_handler",
]


@dataclass
class SyncDescription:
    """One object's state for a sync: plain values (tagged JSON) and tensors.

    A handler that can describe itself this way lets ``TorchState.sync`` send every
    handler's plain part in one message and every handler's tensors in one pipeline of
    buckets (small tensors of several objects share a bucket), instead of a few collectives
    per object.
    """

    plain: Any = None
    tensors: list[torch.Tensor] = field(default_factory=list)


class StateHandler:
    """Saves, restores and broadcasts one object held by a TorchState.

    Subclass it for your own types and ``register_handler(YourType, YourHandler)``. Use
    ``broadcast_tensors`` and ``broadcast_plain`` in ``sync`` so nothing is pickled. A
    handler may instead implement ``describe_sync`` and ``adopt_sync``; a TorchState then
    syncs it together with the others (``sync`` stays its way when used alone).
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def describe_sync(self) -> SyncDescription | None:
        """This object's live state as plain values plus tensors, or None (the default)
        when the handler syncs with its own ``sync()``."""
        return None

    def adopt_sync(self, plain: Any) -> list[torch.Tensor]:
        """On every rank but the sync source (which sends its ``describe_sync().tensors``
        and keeps its object as it is): make the live object match the source's ``plain``
        part and return the live tensors that then receive the source's tensors (same
        order, dtypes and sizes as the source's ``describe_sync().tensors``)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Local work after membership changed (after the sync, if any). Default: nothing."""

    def has_local_progress(self) -> bool:
        """True while this object holds progress recorded on this rank only."""
        return False

    def merge_progress(self) -> None:
        """Collective: merge locally recorded progress of every rank. Default: nothing."""

    def layout(self) -> str:
        """Structure that must be identical on every rank for ``sync`` to work; checked with
        one digest before any handler syncs."""
        return f"{type(self.value).__module__}.{type(self.value).__qualname__}"

    # Durable snapshots (peer_elastic.durable): the live state as named tensors plus a plain
    # value tree (tagged JSON, never pickle), and the way back. Only the rank writing a
    # snapshot calls durable_state, right after a commit (live state == committed state);
    # only the rank loading one calls durable_targets. A handler without them makes the
    # state unsnapshottable (the snapshot writer says so once and stays off).

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        """The live state: tensors by name (aliases; the caller copies) and plain values."""
        raise NotImplementedError(f"{type(self).__name__} does not support durable snapshots")

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        """Make the live object ready to receive a snapshot whose plain part is ``plain``
        (structure, plain values) and return the live tensors to load into, by the names
        ``durable_state`` gave them; they are overwritten in place."""
        raise NotImplementedError(f"{type(self).__name__} does not support durable snapshots")


def _defining_class(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


def describe_for_sync(handler: StateHandler) -> SyncDescription | None:
    """``handler.describe_sync()``, or None when the handler syncs with its own ``sync()``:
    also when a subclass overrides ``sync`` but inherits ``describe_sync`` (its own way of
    syncing must not be bypassed)."""
    cls = type(handler)
    if _defining_class(cls, "sync") is not _defining_class(cls, "describe_sync"):
        return None
    return handler.describe_sync()


class TensorHandler(StateHandler):
    """A tensor kept in the state (e.g. a running metric): copied, not rebound."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self._buffers = Buffers()
        self.save()

    def save(self) -> None:
        self._buffers.capture([(0, self.value)])

    def restore(self) -> None:
        saved = self._buffers[0]
        if not same_meta(saved, self.value):
            raise RuntimeError("tensor changed shape/dtype since the last commit")
        copy_all([self.value.detach()], [saved])

    def sync(self) -> None:
        broadcast_tensors([self.value.detach()])

    def describe_sync(self) -> SyncDescription:
        return SyncDescription(None, [self.value.detach()])

    def adopt_sync(self, plain: Any) -> list[torch.Tensor]:
        return [self.value.detach()]

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        return {"tensor": self.value.detach()}, None

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        return {"tensor": self.value.detach()}

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
        self._buffers = Buffers()
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
                    "type with peer_elastic.register_handler"
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
            same_meta(t, self._buffers[name]) for name, t in items
        ):
            raise RuntimeError(
                "module structure changed since the last commit; commit after changing it"
            )
        copy_all([t for _, t in items], [self._buffers[name] for name, _ in items])

    def sync(self) -> None:
        broadcast_tensors([t for _, t in self._live()])

    def describe_sync(self) -> SyncDescription:
        return SyncDescription(None, [t for _, t in self._live()])

    def adopt_sync(self, plain: Any) -> list[torch.Tensor]:
        return [t for _, t in self._live()]  # the layout, checked by the state, is the same

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        items = self._live()
        return {name: t.detach() for name, t in items}, [name for name, _ in items]

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        live = {name: t.detach() for name, t in self._live()}
        if not isinstance(plain, list) or sorted(plain) != sorted(live):
            raise ValueError(f"snapshot of {type(self.value).__name__} has other entries than "
                             "the live module")
        return live

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
    exist then. sync first broadcasts a JSON description of the sync source's (the newest
    holder's) state (which params have state, each tensor's key/dtype/shape, the plain
    values), so a rank whose optimizer never stepped allocates matching tensors; then all
    tensors go in flat buckets.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._buffers = Buffers()
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
                plain[key] = copy_plain(value)
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
            if isinstance(current, torch.Tensor) and same_meta(current, saved):
                pairs.append((current, saved))
            else:
                live[key] = saved.clone()
        for key, value in entry.plain.items():
            live[key] = copy_plain(value)
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
        copy_all([d for d, _ in pairs], [s for _, s in pairs])

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
        """Make this optimizer's structure match the sync source's (the newest holder's)
        description; return the tensors to receive into, in description order."""
        opt = self.value
        params = self._params()
        groups, state = desc["groups"], desc["state"]
        if len(groups) != len(opt.param_groups) or len(state) != len(params):
            raise ValueError("optimizer param groups differ from the sync source's "
                             f"(rank {sync_source()}, the newest holder)")
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
        if world_size() <= 1:
            return
        desc, tensors = self._describe()
        payload = encode_values({"optimizer": desc}, where=type(self.value).__name__)
        received = decode_values(broadcast_bytes(payload))["optimizer"]
        if dist.get_rank() != sync_source():
            tensors = self._materialize(received)
        broadcast_tensors(tensors)

    def describe_sync(self) -> SyncDescription:
        desc, tensors = self._describe()
        return SyncDescription(desc, tensors)

    def adopt_sync(self, plain: Any) -> list[torch.Tensor]:
        if not isinstance(plain, dict) or set(plain) != {"groups", "state"}:
            raise ValueError("malformed optimizer description from the sync source")
        return self._materialize(plain)

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        # The same description sync() sends: a fresh optimizer can be given this structure.
        desc, tensors = self._describe()
        return {str(i): t for i, t in enumerate(tensors)}, desc

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        if not isinstance(plain, dict) or set(plain) != {"groups", "state"}:
            raise ValueError("malformed optimizer description in snapshot")
        tensors = self._materialize(plain)
        return {str(i): t.detach() for i, t in enumerate(tensors)}

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

    def describe_sync(self) -> SyncDescription:
        return SyncDescription(self.value.state_dict(), [])

    def adopt_sync(self, plain: Any) -> list[torch.Tensor]:
        self.value.load_state_dict(plain)
        return []

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        return {}, self.value.state_dict()

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        self.value.load_state_dict(plain)
        return {}


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

    def durable_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        sd = self.value.state_dict()
        # The progress bits as bytes in the plain part: one small value, no tensor file entry.
        sd["processed_bits"] = sd["processed_bits"].numpy().tobytes()
        return {}, sd

    def durable_targets(self, plain: Any) -> dict[str, torch.Tensor]:
        if not isinstance(plain, dict) or not isinstance(plain.get("processed_bits"), bytes):
            raise ValueError("malformed sampler state in snapshot")
        sd = dict(plain)
        sd["processed_bits"] = torch.frombuffer(bytearray(sd["processed_bits"]), dtype=torch.uint8)
        self.value.load_state_dict(sd)
        return {}

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


def registered_handlers() -> list[tuple[type, HandlerFactory]]:
    """The user registrations, in the order they are consulted."""
    return list(_user_handlers)


def make_handler(value: Any) -> StateHandler | None:
    """The handler for ``value`` (first isinstance match), or None for a plain value."""
    for type_, factory in (*_user_handlers, *_BUILTIN_HANDLERS):
        if isinstance(value, type_):
            handler = factory(value)
            if not isinstance(handler, StateHandler):
                raise TypeError(f"handler factory for {type_.__name__} returned {handler!r}")
            return handler
    return None
