"""ShardedState: an FSDP2 / HSDP model and its optimizer as elastic state, kept in memory.

A module sharded with ``fully_shard`` is bound to its mesh, and a mesh to one process group,
so nothing of it can outlive a generation. What survives is data: at every save (each
commit, and the state a new group agrees on) each rank keeps a copy of its own shard's rows
of every parameter and optimizer tensor, and sends them to the ranks that
:func:`~peer_elastic.sharded.plan.copy_holders` names, so ``redundancy`` ranks may die at
once without losing a row. When a group forms, :mod:`peer_elastic.sharded.regroup` builds a
fresh module on the new mesh (``build`` under ``torch.device("meta")``, then the user's
``parallelize``) and fills it from those copies: no disk, no rank ever holding the full model.

Memory per rank between commits: the live shard, its saved copy and ``redundancy`` copies of
other ranks' shards (fewer under HSDP, where replicas already hold each shard). During a
commit the previous copies stay until every rank confirmed the new ones (:meth:`_save`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from peer_elastic.sharded.catalog import Catalog, catalog_of, install, live_tensors
from peer_elastic.sharded.exchange import flat_views, transfer
from peer_elastic.sharded.plan import MAX_HELD, Holding, Layout, copy_holders, mesh_shape, rows
from peer_elastic.state.agreement import StateVersion
from peer_elastic.state.states import TorchState
from peer_elastic.torch.transport.snapshots import copy_all, same_meta

__all__ = ["Arrived", "SavedShards", "ShardedState"]

ModelBuilder = Callable[[], nn.Module]
Parallelize = Callable[[nn.Module, Any], "nn.Module | None"]
OptimizerBuilder = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class SavedShards:
    """One version's rows on this rank, in one layout: its own shard (``own``, None until
    taken from the live module), the replicated tensors, and copies of other shards."""

    version: StateVersion
    layout: Layout
    shard: int
    catalog: Catalog
    own: list[torch.Tensor] | None
    replicated: list[torch.Tensor] | None
    copies: dict[int, list[torch.Tensor]]

    def holding(self) -> Holding:
        shards = (self.shard, *sorted(s for s in self.copies if s != self.shard))
        return Holding(self.version, self.layout, shards[:MAX_HELD])

    def rows_by_shard(self) -> dict[int, list[torch.Tensor]]:
        """Rows of every sharded tensor (catalog order) by the shard they belong to."""
        assert self.own is not None
        return {**self.copies, self.shard: self.own}


@dataclass(frozen=True)
class Arrived:
    """What a reshard leaves a rank for its first save in the new layout: its rows and the
    replicated tensors it installed (equal to the live ones), and its copies of others."""

    own: list[torch.Tensor]
    replicated: list[torch.Tensor]
    copies: dict[int, list[torch.Tensor]]


def _copies_of(tensors: list[torch.Tensor], reuse: list[torch.Tensor] | None
               ) -> list[torch.Tensor]:
    """Copies of ``tensors``, into ``reuse``'s buffers where their shapes and dtypes match."""
    out = []
    for i, t in enumerate(tensors):
        kept = reuse[i] if reuse is not None and i < len(reuse) else None
        if kept is None or not same_meta(kept, t):
            kept = torch.empty_like(t, memory_format=torch.contiguous_format)
        out.append(kept)
    copy_all(out, [t.detach() for t in tensors])
    return out


def _forget_old_meshes() -> None:
    """Clear DTensor's caches of sharding decisions before a new group's mesh is used.

    They are keyed by mesh *equality* (shape, ranks, dimension names), and the mesh of a new
    group equals an earlier group's mesh of the same shape, while its process groups are
    other ones under other names. A cached decision then names a group of the earlier
    generation: seen as "Could not resolve the process group registered under the name 4"
    on a rank whose place in the mesh changed (HSDP 2 x 2, then 1 x 3, then 2 x 2 again).
    torch exposes the clearing only under private names; without them (another torch) there
    is nothing to clear.
    """
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # pragma: no cover - another torch
        return
    _clear_sharding_prop_cache()
    try:
        from torch.distributed.tensor._redistribute import _gen_transform_infos
    except ImportError:  # pragma: no cover - another torch
        return
    clear = getattr(_gen_transform_infos, "cache_clear", None)
    if clear is not None:
        clear()


class ShardedState(TorchState):
    """Training state whose model (and optimizer) is sharded with FSDP2 or HSDP.

    ``model`` builds the unsharded module (called with no arguments: under a fixed seed on a
    fresh start, so every rank builds the same initial weights, and under
    ``torch.device("meta")`` whenever state already exists); ``parallelize(module, mesh)``
    applies ``fully_shard`` for a given ``DeviceMesh`` (the shape of torchtitan's
    ``parallelize`` functions) and may return the module; ``optimizer(module)`` builds the
    optimizer over the sharded parameters. peer-elastic calls them for every generation, so
    read ``state.model`` and ``state.optimizer`` inside the training function.

    ``shard_degree``: None shards over every rank (FSDP, a 1-D mesh named ``("shard",)``); an
    int S gives HSDP, a 2-D mesh ``("replicate", "shard")`` whose shard size is the smallest
    divisor of the world size that is at least S (:func:`~peer_elastic.sharded.plan.mesh_shape`).
    ``redundancy``: how many ranks may die at once without a disk read (copies kept per shard,
    replicas counted). Every other keyword is a value as in :class:`~peer_elastic.TorchState`
    (sampler, epoch, ...).
    """

    def __init__(self, model: ModelBuilder, parallelize: Parallelize,
                 optimizer: OptimizerBuilder | None = None, *, shard_degree: int | None = None,
                 redundancy: int = 1, init_seed: int = 0, **kwargs: Any) -> None:
        if not callable(model) or isinstance(model, nn.Module):
            raise TypeError("ShardedState(model=...) takes a function that builds the module, "
                            "not a module: the module is rebuilt for every generation's mesh")
        if not callable(parallelize):
            raise TypeError("ShardedState(parallelize=...) must be callable(module, mesh)")
        if optimizer is not None and (not callable(optimizer)
                                      or isinstance(optimizer, torch.optim.Optimizer)):
            raise TypeError("ShardedState(optimizer=...) takes a function of the module that "
                            "builds the optimizer, not an optimizer")
        if shard_degree is not None and shard_degree < 1:
            raise ValueError(f"shard_degree must be at least 1, not {shard_degree}")
        if redundancy < 0:
            raise ValueError(f"redundancy must be at least 0, not {redundancy}")
        object.__setattr__(self, "_build", model)
        object.__setattr__(self, "_parallelize", parallelize)
        object.__setattr__(self, "_make_optimizer", optimizer)
        object.__setattr__(self, "shard_degree", shard_degree)
        object.__setattr__(self, "redundancy", redundancy)
        object.__setattr__(self, "init_seed", init_seed)
        object.__setattr__(self, "_module", None)
        object.__setattr__(self, "_optim", None)
        object.__setattr__(self, "_mesh", None)
        object.__setattr__(self, "_shard_layout", None)  # of the live module
        # What the last save every rank confirmed kept; a newer one whose copies arrived
        # here but was not confirmed everywhere (its own rows: the live ones, taken at the
        # restore); the version the other state (sampler, values) was last saved at.
        object.__setattr__(self, "_confirmed", None)
        object.__setattr__(self, "_unconfirmed", None)
        object.__setattr__(self, "_values_version", None)
        object.__setattr__(self, "_next_version", StateVersion())
        self._adopt_values(kwargs)

    # -- what the training function reads ---------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The live sharded module of this generation."""
        if self._module is None:
            raise RuntimeError("state.model exists once a group formed: read it inside the "
                               "training function that peer-elastic runs")
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The live optimizer of this generation (None without an optimizer builder)."""
        if self._module is None:
            raise RuntimeError("state.optimizer exists once a group formed: read it inside "
                               "the training function that peer-elastic runs")
        return self._optim

    @property
    def mesh(self) -> Any:
        """This generation's ``DeviceMesh``."""
        if self._mesh is None:
            raise RuntimeError("state.mesh exists once a group formed")
        return self._mesh

    @property
    def layout(self) -> Layout | None:
        """How the live module is sharded (None before the first group)."""
        return self._shard_layout

    # -- building for a group ---------------------------------------------------------------

    def new_layout(self, generation: int) -> Layout:
        """The layout this state takes in a group of the default group's size."""
        world = dist.get_world_size()
        return Layout(generation, world, mesh_shape(world, self.shard_degree)[1])

    def _mesh_for(self, layout: Layout, device: torch.device) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        _forget_old_meshes()
        if self.shard_degree is None:
            return init_device_mesh(device.type, (layout.world,), mesh_dim_names=("shard",))
        return init_device_mesh(device.type, (layout.replicas, layout.shards),
                                mesh_dim_names=("replicate", "shard"))

    def _assemble(self, module: nn.Module, mesh: Any, layout: Layout) -> None:
        sharded = self._parallelize(module, mesh)
        module = sharded if isinstance(sharded, nn.Module) else module
        optim = self._make_optimizer(module) if self._make_optimizer is not None else None
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_optim", optim)
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_shard_layout", layout)

    def build_initial(self, layout: Layout, device: torch.device) -> None:
        """Collective: a fresh module on this group's mesh, the same initial weights on every
        rank (built under ``init_seed``)."""
        self._drop_live()
        mesh = self._mesh_for(layout, device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed)
            module = self._build()
        self._assemble(module.to(device), mesh, layout)

    def rebuild(self, layout: Layout, device: torch.device, catalog: Catalog,
                sharded_rows: list[torch.Tensor], replicated: list[torch.Tensor]) -> None:
        """Collective: a module on this group's mesh filled with the given rows (this rank's
        rows of every sharded tensor, in catalog order) and replicated tensors."""
        self.rebuild_empty(layout, device, catalog)
        install(self.model, self._optim, catalog, sharded_rows, replicated)

    def rebuild_empty(self, layout: Layout, device: torch.device, catalog: Catalog) -> None:
        """Collective: an uninitialised module (and optimizer) on this group's mesh, checked
        against ``catalog``'s parameters."""
        self._drop_live()
        mesh = self._mesh_for(layout, device)
        with torch.device("meta"):
            module = self._build()
        sharded = self._parallelize(module, mesh)
        module = sharded if isinstance(sharded, nn.Module) else module
        module.to_empty(device=device)
        expected = {e.name: e.shape for e in catalog.sharded if e.name.startswith("model/")}
        built = {f"model/{n}": tuple(p.shape) for n, p in module.named_parameters()}
        if built != expected:
            raise ValueError("the model built now differs from the saved one: parameters "
                             f"{sorted(set(built) ^ set(expected)) or 'of other shapes'}")
        optim = self._make_optimizer(module) if self._make_optimizer is not None else None
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_optim", optim)
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_shard_layout", layout)

    def _drop_live(self) -> None:
        # The old module's DTensors name their group "0" like the new one: a collective on
        # them would run on the new group with the old layout. Drop them before building.
        object.__setattr__(self, "_module", None)
        object.__setattr__(self, "_optim", None)
        object.__setattr__(self, "_mesh", None)

    # -- what survives a generation ---------------------------------------------------------

    def holdings(self) -> tuple[Holding, ...]:
        """What the saves left on this rank: the last confirmed one, and a newer one whose
        copies arrived here but whose confirmation was cut short (after a restore)."""
        return tuple(saved.holding() for saved in (self._confirmed, self._unconfirmed)
                     if saved is not None and saved.own is not None)

    @property
    def values_version(self) -> StateVersion | None:
        """The version the other state (sampler, plain values) was last saved at."""
        return self._values_version

    def saved(self, version: StateVersion, layout: Layout) -> SavedShards | None:
        """The saved rows of that version in that layout, if this rank holds them."""
        for saved in (self._confirmed, self._unconfirmed):
            if saved is not None and saved.own is not None and saved.version == version \
                    and saved.layout == layout:
                return saved
        return None

    def expect_save(self, version: StateVersion) -> None:
        """The version the next :meth:`save` saves (the run loop names it first)."""
        object.__setattr__(self, "_next_version", version)

    def save(self) -> None:
        """Save the live state as the version :meth:`expect_save` named: this rank's rows and
        the copies of other ranks' (collective once a group formed), then the rest."""
        if self._module is None:
            super().save()
            return
        self._save(self._next_version, ())

    def save_arrived(self, version: StateVersion, arrived: Arrived) -> None:
        """Collective: :meth:`save` of ``version`` right after a reshard, which brought this
        rank's copies along with its rows (one transfer) and whose rows and replicated
        tensors, just installed, are the live state: they are kept as the saved ones."""
        self._save(version, (), arrived=arrived)

    def hand_off(self, version: StateVersion, leaving: bool) -> None:
        """Collective in a group that is about to be replaced: save ``version`` (the live
        state) with the copies of every leaving rank's shard placed on ranks that stay."""
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        flags[dist.get_rank()] = int(leaving)
        device_flags = flags.to(self._device())
        dist.all_reduce(device_flags)
        self._save(version, [r for r, f in enumerate(device_flags.cpu().tolist()) if f])

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _save(self, version: StateVersion, leaving: Iterable[int],
              arrived: Arrived | None = None) -> None:
        """The save, in an order that keeps a complete version in the group whatever rank
        dies during it (with at most ``redundancy`` dead):

        1. the live rows go to the ranks that keep copies of them, into new buffers (the
           previous copies stay);
        2. the other state is saved (this version's values);
        3. one all-reduce: every rank has its copies. Only then does the last save give way
           (the own rows are copied from the live ones, the new copies replace the old).

        Cut short before 3 completes anywhere, every rank still holds the previous save
        whole. Cut short after, every copy of this version exists; a rank whose own step 3
        did not complete keeps this version as unconfirmed, its own rows taken from the live
        ones at the restore (no step ran since), so the group finds it complete.
        ``arrived``: the copies of step 1, already here (step 1 is skipped), and the own
        rows and replicated tensors equal to the live ones (kept instead of copied)."""
        layout = self._shard_layout
        assert layout is not None and self._module is not None
        object.__setattr__(self, "_unconfirmed", None)
        sharded, replicated = live_tensors(self._module, self._optim)
        locals_ = [t.to_local() for _, t in sharded]
        rank = dist.get_rank()
        device = locals_[0].device if locals_ else torch.device("cpu")
        outgoing: dict[int, list[torch.Tensor]] = {}
        incoming: dict[int, list[torch.Tensor]] = {}
        received: dict[int, list[torch.Tensor]] = {}
        holders_by_shard = {} if arrived is not None else \
            copy_holders(layout, self.redundancy, leaving)
        for shard, holders in holders_by_shard.items():
            owners = layout.ranks_of(shard)
            for holder in holders:
                sender = owners[holder % len(owners)]
                if sender == rank:
                    outgoing[holder] = locals_
                if holder == rank:
                    shapes = []
                    for _, t in sharded:
                        lo, hi = rows(t.shape[0], layout.shards, shard)
                        shapes.append(((hi - lo, *t.shape[1:]), t.dtype))
                    incoming[sender] = received[shard] = flat_views(shapes, device)
        transfer(outgoing, incoming)
        if arrived is not None:
            received = arrived.copies
        pending = SavedShards(version, layout, layout.shard_of(rank),
                              catalog_of(self._module, self._optim), None, None, received)
        object.__setattr__(self, "_unconfirmed", pending)
        super().save()
        object.__setattr__(self, "_values_version", version)
        done = torch.ones(1, dtype=torch.int64, device=device)
        dist.all_reduce(done)
        previous = self._confirmed
        reuse = previous is not None and previous.layout == layout and previous.own is not None
        if arrived is not None:
            own, reps = arrived.own, arrived.replicated
        else:
            own = _copies_of(locals_, previous.own if reuse and previous is not None else None)
            reps = _copies_of([t for _, t in replicated],
                              previous.replicated if reuse and previous is not None else None)
        object.__setattr__(self, "_confirmed", SavedShards(
            version, layout, pending.shard, pending.catalog, own, reps, received))
        object.__setattr__(self, "_unconfirmed", None)

    def restore(self) -> None:
        """Back to the last commit: the plain values and other handlers here; the model and
        optimizer are rebuilt from the saved shards when the next group forms (the live
        module belongs to a group that failed). A save whose copies all arrived but whose
        confirmation was cut short takes its own rows from the live module now: nothing
        trained since."""
        pending = self._unconfirmed
        if pending is not None and pending.own is None:
            if self._module is not None and self._shard_layout == pending.layout:
                sharded, replicated = live_tensors(self._module, self._optim)
                pending.own = _copies_of([t.to_local() for _, t in sharded], None)
                pending.replicated = _copies_of([t for _, t in replicated], None)
            else:
                object.__setattr__(self, "_unconfirmed", None)
        super().restore()

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError("ShardedState snapshots are written by every rank "
                                  "(peer_elastic.sharded.durable)")

    # -- durable snapshots (every rank writes its own rows) ---------------------------------

    def durable_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                     dict[str, Any]]:
        """The live state for a sharded snapshot: the sharded DTensors by catalog name, the
        replicated tensors (the model's buffers, plain optimizer tensors and the other
        handlers' tensors, under ``state/``), and the plain part (the catalog, and the
        other values). Live aliases: the writer copies them."""
        assert self._module is not None
        sharded, replicated = live_tensors(self._module, self._optim)
        others, plain = TorchState.durable_state(self)
        rep = dict(replicated)
        rep.update({f"state/{name}": t for name, t in others.items()})
        catalog = catalog_of(self._module, self._optim)
        return dict(sharded), rep, {"catalog": catalog.describe(), "state": plain}

    def load_targets(self, layout: Layout, device: torch.device, plain: dict[str, Any]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                Callable[[], None]]:
        """Collective: a fresh module on this group's mesh, and the tensors a snapshot with
        this ``plain`` part loads into (sharded DTensors, replicated tensors, by the names
        :meth:`durable_parts` gave). Call the returned function once they are loaded: it
        installs them into the module and optimizer. The other values are applied here."""
        from torch.distributed.tensor import DTensor

        catalog = Catalog.parse(plain.get("catalog"))
        state_plain = plain.get("state")
        if not isinstance(state_plain, dict):
            raise ValueError("snapshot without the state's values")
        self.rebuild_empty(layout, device, catalog)
        params = dict(self.model.named_parameters())
        shard = layout.shard_of(dist.get_rank())
        sharded_rows: list[torch.Tensor] = []
        targets: dict[str, torch.Tensor] = {}
        for entry in catalog.sharded:
            lo, hi = rows(entry.rows, layout.shards, shard)
            local = torch.zeros((hi - lo, *entry.row_shape), dtype=entry.torch_dtype,
                                device=device)
            fqn = entry.name.split("/", 1)[1]
            if entry.name.startswith("optimizer/"):
                fqn = fqn.rpartition("/")[0]
            param = params[fqn]
            assert isinstance(param, DTensor)
            sharded_rows.append(local)
            targets[entry.name] = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False,
                shape=torch.Size(entry.shape), stride=param.stride())
        replicated = [torch.zeros(e.shape, dtype=e.torch_dtype, device=device)
                      for e in catalog.replicated]
        rep_targets = {e.name: t for e, t in zip(catalog.replicated, replicated, strict=True)}
        others = TorchState.durable_targets(self, state_plain)
        rep_targets.update({f"state/{name}": t for name, t in others.items()})

        def install_loaded() -> None:
            install(self.model, self._optim, catalog, sharded_rows, replicated)

        return targets, rep_targets, install_loaded
