"""What the elastic run loop needs of a training state, as Protocols.

``State``, ``ObjectState``, ``TorchState`` (:mod:`.states`) and a sharded state
(``peer_elastic.sharded.ShardedState``) implement them, and so does a user's ``State``
subclass: the run loop (``peer_elastic.elastic.Peer``), the agreement of a new group
(:mod:`.sync`) and durable snapshots (``peer_elastic.durable``) type a state by the part they
use, and never ask whether it has an attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch only for the annotations: this module imports without it
    import torch

__all__ = ["DurableState", "ElasticState", "HostChecker", "SyncedState"]

HostChecker = Callable[[Any, bool], None]
"""What ``commit()`` (``committing=True``) and ``check_host_updates()`` call once a run loop
attached one: ``checker(state, committing)``. It may raise HostsUpdatedInterrupt; when
committing it calls ``state.record_commit()`` once the ranks agreed."""


class SyncedState(Protocol):
    """What a new group's agreement (:func:`~peer_elastic.state.sync.agree_and_sync`) uses."""

    #: Commits this state holds; the agreement sets it to the agreed version's.
    commit_count: int

    def sync(self) -> None:
        """Collective: make every rank's live state equal to the sync source's."""
        ...

    def save(self) -> None:
        """Copy the live state into memory (the restore point)."""
        ...


class DurableState(Protocol):
    """What durable snapshots (``peer_elastic.durable``) write and load."""

    def durable_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The live state: tensors by name (live aliases) and a tree of plain values."""
        ...

    def durable_targets(self, plain: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Apply a snapshot's plain part; the live tensors its tensors load into, by name."""
        ...


class ElasticState(SyncedState, DurableState, Protocol):
    """What the run loop (``peer_elastic.elastic.Peer``) uses of the state given to ``run``."""

    def attach(self, checker: HostChecker | None) -> None:
        """Route ``commit()`` and ``check_host_updates()`` through ``checker``."""
        ...

    def record_commit(self) -> None:
        """Save and count one commit: the local half of ``commit()``."""
        ...

    def has_local_progress(self) -> bool:
        """Whether this rank holds progress the other ranks do not know yet."""
        ...

    def merge_progress(self) -> None:
        """Collective: merge every rank's locally recorded progress."""
        ...

    def restore(self) -> None:
        """Return the live state to the last ``save``."""
        ...

    def on_reset(self) -> None:
        """Each time a group forms, once state is synced: handlers' reset, then callbacks."""
        ...
