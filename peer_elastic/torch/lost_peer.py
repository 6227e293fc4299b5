"""The hang watchdog's question about the group this peer trains in: can it still complete a
collective, and if not, how long does the training thread get to leave it by itself
(:class:`~peer_elastic.torch.gloo.abort.Loss`)?

Reads memory only (the coordinator's registration and its watched view, and the probes of
members already lost), never etcd. Nothing here imports torch.
"""

from __future__ import annotations

from peer_elastic.etcd.deaths import all_gone
from peer_elastic.etcd.stop import CANNOT_COMPLETE, MembershipFacts, StopCause, stop_reason
from peer_elastic.torch.formed_group import FormedGroup
from peer_elastic.torch.gloo.abort import Loss

__all__ = ["lost_peer"]

#: The grace of a group whose lost members are all confirmed dead.
_DEAD_PEER_GRACE_S = 0.5


def lost_peer(coord: MembershipFacts, group: FormedGroup,
              join_timeout_s: float) -> Loss | None:
    """Why ``group`` can no longer complete a collective, or None while it can.

    A roster member whose key is gone lost its lease (crashed, hung or cut off), and so
    did this peer if it lost its registration since the group formed. The training
    thread gets a join timeout (``join_timeout_s``) to leave such a group by itself, so
    that a step merely in progress is not thrown away. None when this peer itself is the
    one that lost its lease: its step is thrown away anyway, and it registers again only
    once it is out (``GroupManager.left_lost_registration``). A short one when every lost
    member's probe port refuses now (its process is gone) and none of them left
    gracefully: no step that waits on it can complete, and a collective normally fails at
    once on its closed connections, so the training thread is on its way out already (the
    grace spares it a race with its own teardown); one still waiting means that something
    else holds them open (a program it started that inherited them, a child forked outside
    Python), and would hold this peer there for the whole join timeout.
    """
    if group.assignment.size <= 1:
        return None  # alone: no collective can wait on anyone
    reason = stop_reason(coord, group, causes=CANNOT_COMPLETE)
    if reason is None or reason.cause is StopCause.JOB_DONE:
        return None  # finished: peers leave one by one, nothing is stuck
    own = reason.cause is StopCause.LEASE_LOST or (
        reason.cause is StopCause.PEER_LOST and coord.member_id in reason.lost)
    if own:
        return Loss(reason.detail, 0.0)
    if reason.cause is StopCause.PEER_LOST and not (
            set(reason.lost) & coord.snapshot().drains):
        deaths = all_gone(group.probes, reason.lost)
        if deaths is not None:
            return Loss(f"{reason.detail}; " + ", ".join(
                f"{d.member_id}: {d.describe()}" for d in deaths),
                min(_DEAD_PEER_GRACE_S, join_timeout_s))
    return Loss(reason.detail, join_timeout_s)
