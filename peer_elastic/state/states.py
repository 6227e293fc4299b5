"""Training state that survives membership changes: commit, restore and sync (Horovod Elastic).

``State.commit()`` saves a copy in memory and checks for a pending membership change;
``restore()`` returns to the last commit after a failed collective; ``sync()`` makes every
rank hold the sync source's state (the rank holding the newest committed version, chosen
by the run loop; rank 0 outside it) after a new process group is formed.

Why it is shaped this way:

* ``commit`` runs every few batches, so handlers copy tensors into buffers they keep
  (``peer_elastic.torch.transport.snapshots``) instead of ``deepcopy``/pickle per commit.
* ``sync`` runs after resets, when everybody waits for it, so it sends tensors in large flat
  buckets (``peer_elastic.torch.transport.collectives``) instead of one pickled object per tensor.
* Anything received from another peer is untrusted input: plain values travel as tagged JSON
  (``peer_elastic.state.codec``), never pickle. Other types need a handler
  (``peer_elastic.state.handlers``).

How the elastic run loop (``peer_elastic.elastic.Peer``) uses a state::

    state.attach(checker)          # commit() and check_host_updates() go through it
    while True:
        <form the new process group>
        <agree on the newest state version; sync from a rank holding it if ranks differ>
        state.on_reset()           # handlers' reset (samplers re-partition), then callbacks
        try:
            return train(state)    # calls state.commit() every few batches
        except HostsUpdatedInterrupt:
            pass                   # keep live state (progress was merged first)
        except <a collective failed>:
            state.restore()

The checker makes a commit safe under failures: it first agrees with the other ranks (one
all-reduce), merges progress some rank recorded only locally (``record_indices``), and only
then calls ``record_commit()`` (save and count); see ``peer_elastic.state.agreement``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from peer_elastic.state.codec import copy_plain, decode_values, encode_values
from peer_elastic.state.handlers import (
    StateHandler,
    describe_for_sync,
    make_handler,
    register_handler,
)
from peer_elastic.state.protocol import HostChecker
from peer_elastic.torch.transport.collectives import (
    SourceCannotSend,
    broadcast_bytes,
    broadcast_tensors,
    world_size,
)
from peer_elastic.torch.transport.layout_check import (
    LayoutCheck,
    broadcast_validated,
    start_layout_check,
)
from peer_elastic.torch.transport.sync_source import is_sync_source

__all__ = ["ObjectState", "State", "TorchState"]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block.

    A sync allocates tens of thousands of short-lived objects (an optimizer's description:
    a few per parameter tensor) while the model and optimizer hold far more long-lived ones.
    Every collection those allocations trigger walks the long-lived objects and frees
    nothing (reference counting frees the description): about 50 ms per sync of a model
    with 2,400 state tensors, a third of it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
        one and joiners' included), once state is synced: ``reset()`` then the reset
        callbacks. Callbacks may run collectives (e.g. rebuild DDP): every rank enters them
        together, holding the same state."""
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
        """Collective: make every rank's live state equal to the sync source's (the rank the
        run loop chose as holding the newest state; rank 0 outside the run loop)."""
        raise NotImplementedError

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The live state for a durable snapshot (``peer_elastic.durable``): tensors by name
        (live aliases: the caller copies them) and a tree of plain values (tagged JSON)."""
        raise NotImplementedError(f"{type(self).__name__} does not support durable snapshots")

    def durable_targets(self, plain: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Apply a snapshot's plain part to the live state and return the live tensors its
        tensors are loaded into, by the names ``durable_state`` gave them."""
        raise NotImplementedError(f"{type(self).__name__} does not support durable snapshots")


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
    snapshot back, ``sync`` sends the sync source's values as tagged JSON: only plain values
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
        self._saved = {name: copy_plain(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name in self._names:
            setattr(self, name, copy_plain(self._saved[name]))

    def sync(self) -> None:
        """The sync source's values on every rank: the rank holding the newest committed
        version, which need not be rank 0 (all ranks end with the decoded values, so types
        such as numpy scalars become the same builtins everywhere)."""
        payload = encode_values(
            {name: getattr(self, name) for name in self._names}, where=type(self).__name__
        )
        if world_size() <= 1:
            return
        values = decode_values(broadcast_bytes(payload))
        if set(values) != set(self._names):
            raise ValueError(
                f"state attributes differ from the sync source's: {sorted(values)} vs "
                f"{sorted(self._names)}"
            )
        for name in self._names:
            setattr(self, name, values[name])

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"values": {name: copy_plain(getattr(self, name)) for name in self._names}}

    def durable_targets(self, plain: dict[str, Any]) -> dict[str, torch.Tensor]:
        values = plain.get("values")
        if not isinstance(values, dict) or set(values) != set(self._names):
            raise ValueError(f"snapshot values {sorted(values or ())} differ from the state's "
                             f"{sorted(self._names)}")
        for name in self._names:
            setattr(self, name, values[name])
        return {}


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
        self._adopt_values({"model": model, "optimizer": optimizer, **kwargs})

    def _adopt_values(self, values: dict[str, Any]) -> None:
        """Give every value with a handler to it, and keep the rest as plain values."""
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
        """The sync source's state on every rank, in as few collectives as the handlers
        allow: a two-word all-reduce that checks the layout (issued first, it travels while
        the source describes and encodes), one broadcast with every plain part (the
        handlers' descriptions and the plain values; a second one for the rest when they
        exceed 16 KiB), one pipeline of buckets with every describable handler's tensors;
        then each other handler's own ``sync()``.

        Only the source describes its handlers and encodes the plain part, and it keeps its
        own objects and sends the tensors its handlers described; the others decode it,
        their handlers adopt it, and the handlers it leaves out sync themselves.
        (With thousands of optimizer entries, encoding on every rank and decoding on the
        source cost more than the bytes: each was on the critical path.) A value the source
        cannot send fails the sync on every rank, the source with the error naming it."""
        if world_size() <= 1:
            super().sync()  # still validates that plain values are sendable
            return
        with _collector_paused():
            self._sync_described()

    def _sync_described(self) -> None:
        # The layout check travels while the source describes its handlers and encodes the
        # plain part: that is every sync's critical path.
        layout = start_layout_check(self._layout(), "TorchState layout")
        names = sorted(self._handlers)
        if is_sync_source():
            self._send_described(layout, names)
        else:
            self._receive_described(layout, names)

    def _send_described(self, layout: LayoutCheck, names: list[str]) -> None:
        described = {name: describe_for_sync(self._handlers[name]) for name in names}
        # The payload names exactly the described handlers: that tells the others which
        # handlers sync with their own sync() (they never describe theirs).
        plain = {name: d.plain for name, d in described.items() if d is not None}
        values = {name: getattr(self, name) for name in self._names}
        payload: bytes | None
        refusal: TypeError | None = None
        try:
            payload = encode_values({"handlers": plain, "values": values},
                                    where=type(self).__name__)
        except TypeError as exc:
            payload, refusal = None, exc
        try:
            broadcast_validated(payload, layout, "TorchState layout")
        except SourceCannotSend:
            if refusal is not None:
                raise refusal from None
            raise
        broadcast_tensors([t for d in described.values() if d is not None for t in d.tensors])
        for name, description in described.items():
            if description is None:
                self._handlers[name].sync()

    def _receive_described(self, layout: LayoutCheck, names: list[str]) -> None:
        received = decode_values(broadcast_validated(b"", layout, "TorchState layout"))
        plain, values = received.get("handlers"), received.get("values")
        if (not isinstance(plain, dict) or not set(plain) <= set(names)
                or not isinstance(values, dict) or set(values) != set(self._names)):
            raise ValueError("malformed state from the sync source: handlers "
                             f"{sorted(plain) if isinstance(plain, dict) else plain!r}, values "
                             f"{sorted(values) if isinstance(values, dict) else values!r}")
        tensors: list[torch.Tensor] = []
        for name in names:
            if name in plain:
                tensors += self._handlers[name].adopt_sync(plain[name])
        broadcast_tensors(tensors)
        for name in self._names:
            setattr(self, name, values[name])
        for name in names:
            if name not in plain:
                self._handlers[name].sync()

    def reset(self) -> None:
        for handler in self._ordered_handlers():
            handler.reset()

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, plain = super().durable_state()
        handlers: dict[str, Any] = {}
        for name in sorted(self._handlers):
            own, handlers[name] = self._handlers[name].durable_state()
            tensors.update({f"{name}/{key}": t for key, t in own.items()})
        return tensors, {**plain, "handlers": handlers}

    def durable_targets(self, plain: dict[str, Any]) -> dict[str, torch.Tensor]:
        handlers = plain.get("handlers")
        if not isinstance(handlers, dict) or set(handlers) != set(self._handlers):
            raise ValueError(f"snapshot holds {sorted(handlers or ())}, the state "
                             f"{sorted(self._handlers)}")
        targets = super().durable_targets(plain)
        for name in sorted(self._handlers):
            own = self._handlers[name].durable_targets(handlers[name])
            targets.update({f"{name}/{key}": t for key, t in own.items()})
        return targets

    def has_local_progress(self) -> bool:
        return any(h.has_local_progress() for h in self._handlers.values())

    def merge_progress(self) -> None:
        # Every handler, in a fixed order: the collectives must match on every rank, also on
        # a rank whose own sampler recorded nothing.
        for handler in self._ordered_handlers():
            handler.merge_progress()
