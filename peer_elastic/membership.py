"""What the training side reads of this peer's membership: its registration and the watched
view of its job, from memory.

The coordinator (:class:`peer_elastic.etcd.coordinator.Coordinator`) owns them. Each part of
the training side types it by the :class:`~typing.Protocol` of what that part uses (the
group manager's ``GroupCoordinator``, the peer's ``PeerCoordinator``, ...), so that a test
fake implements no more than that and no part reaches for more. :class:`MembershipFacts` is
what every decision of :func:`peer_elastic.etcd.stop.stop_reason` reads, shared by the
parts that ask it. Nothing here imports torch.
"""

from __future__ import annotations

import threading
from typing import Protocol

from peer_elastic.errors import PeerElasticError
from peer_elastic.etcd.view import ViewSnapshot

__all__ = ["MembershipFacts"]


class MembershipFacts(Protocol):
    """This peer's registration and the watched view: what ``stop_reason`` reads."""

    #: This peer's member id ("" before it registers).
    member_id: str
    job: str
    #: Bumped each time this peer registers again after a lost lease: a group formed under
    #: another incarnation belongs to a lost registration.
    incarnation: int
    #: The coordination's fatal error, once it failed for good.
    error: PeerElasticError | None
    #: Set once this peer was asked to leave (SIGTERM, drain).
    drain_requested: threading.Event

    def snapshot(self) -> ViewSnapshot:
        """The newest picture of the job (no etcd I/O)."""
        ...
