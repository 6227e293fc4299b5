"""What one member's coordination thread did, counted: :class:`CoordinatorCounters`.

The :class:`~peer_elastic.etcd.coordinator.Coordinator` owns one and hands it to its
:class:`~peer_elastic.etcd.leader.Leader`; both count on the coordination thread only, and
metrics read :meth:`CoordinatorCounters.as_dict` from any thread. Nothing here imports
torch.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CoordinatorCounters"]


@dataclasses.dataclass
class CoordinatorCounters:
    """Counters of one member's coordination (the training side keeps
    :class:`~peer_elastic.observer.PeerStats`)."""

    #: Generations this member wrote as leader.
    generations_written: int = 0
    #: Generation writes this member lost to a concurrent leader (compare-and-swap).
    cas_lost: int = 0
    #: Times this member registered again after losing its lease.
    rejoins: int = 0
    #: Silent members this member dropped as leader (their leases revoked).
    dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by its name (the metric names: ``peer_elastic_coordinator_<name>_total``)."""
        return dataclasses.asdict(self)
