"""What a sharded model and its optimizer hold, by stable names, and how to put it back.

A :class:`Catalog` lists every tensor of the state in one fixed order: the *sharded* ones
(DTensor parameters and the optimizer's per-parameter DTensors, dim 0 split over the shard
mesh dimension) and the *replicated* ones (module buffers, plain optimizer tensors such as
Adam's ``step``), with their global shapes and dtypes, plus the optimizer's hyperparameters.
Every rank of a group builds the same catalog from its own module and optimizer, so its
order is the order tensors travel in; a receiver that holds nothing (a joiner) builds its
tensors from the catalog the sync source sends.

Names: ``model/<fqn>`` for parameters and buffers, ``optimizer/<fqn>/<key>`` for optimizer
state (fqn of the parameter it belongs to).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from peer_elastic.state.codec import copy_plain

__all__ = ["Catalog", "Entry", "catalog_of", "install", "live_tensors"]


@dataclass(frozen=True)
class Entry:
    """One tensor of the state: its name, global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    def describe(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def parse(cls, value: Any) -> Entry:
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not isinstance(value[1], list) or not isinstance(value[2], str)
                or not all(isinstance(d, int) and d >= 0 for d in value[1])
                or not value[2].startswith("torch.")
                or not isinstance(getattr(torch, value[2][6:], None), torch.dtype)):
            raise ValueError(f"malformed catalog entry {value!r}")
        return cls(value[0], tuple(value[1]), value[2])

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype[6:])
        assert isinstance(dtype, torch.dtype)
        return dtype


@dataclass(frozen=True)
class Catalog:
    """Every tensor of a sharded state, in travel order, and the optimizer's settings."""

    sharded: tuple[Entry, ...]
    replicated: tuple[Entry, ...]
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters, without "params"

    def describe(self) -> dict[str, Any]:
        return {"sharded": [e.describe() for e in self.sharded],
                "replicated": [e.describe() for e in self.replicated],
                "param_groups": [dict(g) for g in self.param_groups]}

    @classmethod
    def parse(cls, value: Any) -> Catalog:
        if not isinstance(value, dict) or set(value) != {"sharded", "replicated", "param_groups"}:
            raise ValueError("malformed catalog")
        groups = value["param_groups"]
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("malformed catalog param_groups")
        return cls(tuple(Entry.parse(e) for e in value["sharded"]),
                   tuple(Entry.parse(e) for e in value["replicated"]),
                   tuple(dict(g) for g in groups))

    def layout(self) -> str:
        """The part every rank of a group must agree on (names, shapes, dtypes)."""
        return repr((self.sharded, self.replicated))


def _fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_items(model: nn.Module, optimizer: torch.optim.Optimizer | None
                     ) -> Iterator[tuple[str, str, Any]]:
    """(fqn, key, value) of the optimizer state, sorted by fqn then key."""
    if optimizer is None:
        return
    names = _fqns(model)
    items = []
    for param, entries in optimizer.state.items():
        fqn = names.get(id(param))
        if fqn is None:
            raise ValueError("the optimizer holds state for a tensor that is not a parameter "
                             "of the model: build it from the model's parameters")
        for key, value in entries.items():
            items.append((fqn, str(key), value))
    yield from sorted(items, key=lambda item: (item[0], item[1]))


def live_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> tuple[list[tuple[str, DTensor]], list[tuple[str, torch.Tensor]]]:
    """The live sharded and replicated tensors, named, in catalog order."""
    sharded: list[tuple[str, DTensor]] = []
    replicated: list[tuple[str, torch.Tensor]] = []
    for name, param in sorted(model.named_parameters()):
        if not isinstance(param, DTensor):
            raise TypeError(f"parameter {name} is not sharded: parallelize() must apply "
                            "fully_shard to every parameter (its root module included)")
        sharded.append((f"model/{name}", param))
    for name, buf in sorted(model.named_buffers()):
        replicated.append((f"model/{name}", buf))
    for fqn, key, value in _optimizer_items(model, optimizer):
        name = f"optimizer/{fqn}/{key}"
        if isinstance(value, DTensor):
            sharded.append((name, value))
        elif isinstance(value, torch.Tensor):
            replicated.append((name, value))
        else:
            raise TypeError(f"optimizer state {name} is a {type(value).__name__}; only tensors "
                            "are kept (hyperparameters belong in param_groups)")
    return sharded, replicated


def catalog_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Catalog:
    sharded, replicated = live_tensors(model, optimizer)
    groups = tuple({k: copy_plain(v) for k, v in g.items() if k != "params"}
                   for g in (optimizer.param_groups if optimizer is not None else ()))
    return Catalog(tuple(Entry(n, tuple(t.shape), str(t.dtype)) for n, t in sharded),
                   tuple(Entry(n, tuple(t.shape), str(t.dtype)) for n, t in replicated),
                   groups)


def install(model: nn.Module, optimizer: torch.optim.Optimizer | None, catalog: Catalog,
            sharded_rows: list[torch.Tensor], replicated: list[torch.Tensor]) -> None:
    """Fill a freshly built ``model`` and ``optimizer`` (this group's mesh) from local rows
    of every sharded tensor and the replicated tensors, in ``catalog`` order.

    Parameters get their rows copied into FSDP's own storage; optimizer state is created as
    DTensors over the new rows with the parameter's mesh, placements and global shape (a
    DTensor built without ``shape=`` infers rows x shards, wrong for uneven shards). The
    optimizer's hyperparameters come back too: an optimizer built with a different learning
    rate must go on with the saved one.
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    by_fqn: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for entry, local in zip(catalog.sharded, sharded_rows, strict=True):
            kind, _, rest = entry.name.partition("/")
            if kind == "model":
                param = params[rest]
                assert isinstance(param, DTensor)
                param.to_local().copy_(local)
            else:
                fqn, _, key = rest.rpartition("/")
                param = params[fqn]
                assert isinstance(param, DTensor)
                # a copy: the optimizer updates its state in place, and the rows given
                # may be kept as the saved state
                by_fqn.setdefault(fqn, {})[key] = DTensor.from_local(
                    local.clone(), param.device_mesh, param.placements, run_check=False,
                    shape=torch.Size(entry.shape), stride=param.stride())
        for entry, value in zip(catalog.replicated, replicated, strict=True):
            kind, _, rest = entry.name.partition("/")
            if kind == "model":
                buffers[rest].copy_(value)
            else:
                fqn, _, key = rest.rpartition("/")
                by_fqn.setdefault(fqn, {})[key] = value.clone()
    if optimizer is None:
        return
    if len(optimizer.param_groups) != len(catalog.param_groups):
        raise ValueError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, "
                         f"the state {len(catalog.param_groups)}")
    for group, saved in zip(optimizer.param_groups, catalog.param_groups, strict=True):
        group.update(copy_plain(saved))
    optimizer.state.clear()
    for fqn, entries in by_fqn.items():
        optimizer.state[params[fqn]] = entries
