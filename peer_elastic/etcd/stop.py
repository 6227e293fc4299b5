"""Who decides that a group must stop: :func:`stop_reason`, and nothing else.

Four questions read the same facts (the coordinator's fatal error and registration, and the
watched view: ``done``, the newest generation, the members) and used to decide each on its
own:

* the per-step check (``Peer._check``): must every rank reset at this call although no newer
  generation is pending? (:data:`RESET_NOW`)
* the hang watchdog (``GroupManager.lost_peer``): can this group still complete a
  collective? (:data:`CANNOT_COMPLETE`)
* a rendezvous in progress (``GroupManager`` forming a group): give up on this generation?
  (:data:`ABANDON_RENDEZVOUS` until every member passed its commit point; after that, only
  when the group cannot complete: :data:`CANNOT_COMPLETE`)
* :meth:`Coordinator.check <peer_elastic.etcd.coordinator.Coordinator.check>`: does this
  peer's participation end? (:data:`LEAVE_JOB`; the error it raises: :func:`participation_end`)

What it reads of the coordinator is :class:`MembershipFacts`, so this module sits below the
coordinator, which asks it too.

Each asks :func:`stop_reason` with the causes it acts on; the answer is a typed
:class:`StopReason` (a :class:`StopCause` and a text for humans). Causes are tried in the
order :class:`StopCause` lists them, so one set of facts always gives one answer.

Nothing here imports torch.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from peer_elastic.errors import LeaveRequested, PeerElasticError
from peer_elastic.etcd.done import done_error
from peer_elastic.etcd.view import ViewSnapshot

__all__ = [
    "ABANDON_RENDEZVOUS",
    "ALL_CAUSES",
    "CANNOT_COMPLETE",
    "MembershipFacts",
    "LEAVE_JOB",
    "RESET_NOW",
    "GroupId",
    "GroupRef",
    "StopCause",
    "StopReason",
    "participation_end",
    "stop_reason",
]


class StopCause(enum.Enum):
    """Why a group (or this peer's participation) must stop, most severe first."""

    FATAL = "fatal"  # the coordinator failed for good (its ``error``)
    LEASE_LOST = "lease_lost"  # this peer lost its registration since the group formed
    JOB_DONE = "job_done"  # the run's ``done`` record exists
    LEFT = "left"  # this peer was drained and the newest roster no longer lists it
    PEER_LOST = "peer_lost"  # a roster member's key is gone (its lease ended)
    CUT_OFF = "cut_off"  # a roster member is cut off from the others' groups (etcd/reach.py)
    SUPERSEDED = "superseded"  # the newest generation is another one
    NOT_IN_ROSTER = "not_in_roster"  # the group's generation no longer lists this peer


@dataclass(frozen=True)
class StopReason:
    """A typed answer of :func:`stop_reason`; ``detail`` is for logs and events."""

    cause: StopCause
    detail: str
    lost: tuple[str, ...] = ()  # PEER_LOST, CUT_OFF: the roster members concerned

    def __str__(self) -> str:
        return self.detail


class MembershipFacts(Protocol):
    """This peer's registration and the watched view of its job, from memory: what
    :func:`stop_reason` reads. The :class:`~peer_elastic.etcd.coordinator.Coordinator` owns
    them; the training side's parts extend this Protocol with what else each one uses, so a
    test fake implements no more than that."""

    @property
    def job(self) -> str: ...

    @property
    def member_id(self) -> str: ...

    @property
    def incarnation(self) -> int: ...  # changes when this peer loses its registration

    @property
    def error(self) -> PeerElasticError | None: ...  # the fatal error, once there is one

    @property
    def drain_requested(self) -> threading.Event: ...  # this peer asked to leave

    def snapshot(self) -> ViewSnapshot: ...  # the watched view's newest picture


class GroupRef(Protocol):
    """What :func:`stop_reason` needs to know of a group."""

    @property
    def generation(self) -> int: ...

    @property
    def roster(self) -> Sequence[str]: ...

    @property
    def incarnation(self) -> int: ...


@dataclass(frozen=True)
class GroupId:
    """A group not formed yet (a rendezvous in progress): its generation, roster and the
    coordinator's registration it is formed under."""

    generation: int
    roster: tuple[str, ...]
    incarnation: int


#: The per-step check forces a reset at once (every rank stops at the same call).
RESET_NOW = frozenset({StopCause.FATAL, StopCause.LEASE_LOST, StopCause.JOB_DONE})
#: The watchdog: the group's collectives cannot complete (JOB_DONE means they need not:
#: peers leave one by one, nothing is stuck).
CANNOT_COMPLETE = frozenset({StopCause.FATAL, StopCause.LEASE_LOST, StopCause.JOB_DONE,
                             StopCause.PEER_LOST, StopCause.CUT_OFF})
#: A rendezvous gives up on its generation (before its commit point, see
#: ``peer_elastic.torch.barrier``).
ABANDON_RENDEZVOUS = frozenset({StopCause.FATAL, StopCause.JOB_DONE, StopCause.SUPERSEDED,
                                StopCause.NOT_IN_ROSTER})
#: This peer's participation in the job ends (no group needed).
LEAVE_JOB = frozenset({StopCause.FATAL, StopCause.JOB_DONE, StopCause.LEFT})


ALL_CAUSES = frozenset(StopCause)


def stop_reason(coord: MembershipFacts, group: GroupRef | None,
                snap: ViewSnapshot | None = None, *,
                causes: Collection[StopCause] = ALL_CAUSES) -> StopReason | None:
    """The first of ``causes`` (in :class:`StopCause` order) that holds for ``group``, or None.

    ``group`` None asks about this peer alone: the causes that need a group never hold.
    Reads memory only (the coordinator and its watched view), never etcd.
    """
    snap = snap if snap is not None else coord.snapshot()
    for cause in StopCause:
        if cause in causes:
            reason = _check(cause, coord, group, snap)
            if reason is not None:
                return reason
    return None


def participation_end(coord: MembershipFacts, snap: ViewSnapshot) -> PeerElasticError | None:
    """The error that ends this peer's participation in the job (:data:`LEAVE_JOB`), or None:
    the coordinator's fatal error, the job's end (:func:`~peer_elastic.etcd.done.done_error`),
    or :class:`~peer_elastic.errors.LeaveRequested` once a drain took effect."""
    reason = stop_reason(coord, None, snap, causes=LEAVE_JOB)
    if reason is None:
        return None
    if reason.cause is StopCause.FATAL and coord.error is not None:
        return coord.error
    if reason.cause is StopCause.JOB_DONE and snap.done is not None:
        return done_error(coord.job, snap.done)
    return LeaveRequested(reason.detail)


def _check(cause: StopCause, coord: MembershipFacts, group: GroupRef | None,
           snap: ViewSnapshot) -> StopReason | None:
    newest = snap.generation
    if cause is StopCause.FATAL:
        err = coord.error
        return None if err is None else StopReason(cause, str(err))
    if cause is StopCause.JOB_DONE:
        return None if snap.done is None else StopReason(cause, "the job finished")
    if cause is StopCause.LEFT:
        listed = newest is not None and coord.member_id in newest.roster
        if coord.drain_requested.is_set() and not listed:
            return StopReason(cause, f"member {coord.member_id} left job {coord.job!r} as "
                                     "requested")
        return None
    if group is None:
        return None
    n = group.generation
    if cause is StopCause.LEASE_LOST:
        if coord.incarnation != group.incarnation:
            return StopReason(cause, f"this peer lost its lease during generation {n}")
        return None
    if cause is StopCause.PEER_LOST:
        gone = tuple(m for m in group.roster if m not in snap.members)
        if not gone:
            return None
        return StopReason(cause, f"{', '.join(gone)} of generation {n} lost "
                                 f"{'its lease' if len(gone) == 1 else 'their leases'}", gone)
    if cause is StopCause.CUT_OFF:
        # The reports say a member and the others cannot reach each other: a collective
        # among them waits for the collective timeout, whichever side this peer is on.
        cut = tuple(m for m in group.roster if m in snap.cut_off())
        if not cut:
            return None
        return StopReason(cause, f"{', '.join(cut)} of generation {n} "
                                 f"{'is' if len(cut) == 1 else 'are'} cut off from the "
                                 "others' process groups (reported unreachable)", cut)
    if cause is StopCause.SUPERSEDED:
        if snap.generation_number != n:
            return StopReason(cause, f"generation {n} was superseded by "
                                     f"{snap.generation_number}")
        return None
    # NOT_IN_ROSTER
    if coord.member_id not in (newest.roster if newest is not None else ()):
        return StopReason(cause, "this peer is no longer in the roster")
    return None
