"""A member taking itself out of its job for good: fencing.

A peer that finds itself unfit to train (its training thread hung, see
:mod:`peer_elastic.liveness`) must leave so that the others re-form at once, and must never
come back as the same member. :func:`fence_member` does that in an order that keeps every
step safe:

1. the coordinator is closed without leaving: its thread stops, so this member can no
   longer acknowledge generations, lead, or re-register after its lease goes;
2. one transaction writes ``<run>/fenced/<member>`` (a :class:`FenceRecord` under a lease
   of its own, :func:`fence_ttl_s`), an event, and deletes the member key. Whoever sees the
   member go therefore also sees why: the leader names the cause in the next generation's
   reason, and ``ViewSnapshot.eligible`` never lists a fenced member again;
3. the member lease is revoked, which ends anything else still attached to it (acks), and
   makes the other peers' :class:`~peer_elastic.torch.gloo.abort.HangWatchdog` abandon any
   collective stuck on this peer.

The fence record is needed only until the generation that removes the member is written
(the member key goes in the same transaction, and the process exits), so it does not live
as long as the run: a long run that fences many members would otherwise keep every record,
and every watcher would read them all at each start. Its lease ends it
:func:`fence_ttl_s` later; the event (``peer-elastic events``) keeps the history. Should
that lease not be granted, the record falls back to the run lease.

Every step is bounded by the client's retry budget and best effort: the caller exits the
process afterwards whatever happened, and a process that is gone is a crash, which the
others already recover from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from peer_elastic.etcd.client import Txn
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.records import EventRecord, FenceCause, FenceRecord, JobConfig, encode

log = logging.getLogger(__name__)

#: The event kind a fenced member writes for each cause (``peer-elastic events`` shows it).
EVENT_KINDS = {FenceCause.FENCE_CAUSE_HUNG: "hung"}


#: A fence record lives at least this long, however short the run's timeouts.
MIN_FENCE_TTL_S = 60.0


def fence_ttl_s(config: JobConfig) -> float:
    """How long a fence record is kept: well past the generation that removes the member.

    That generation comes ``settle_s`` after the member key goes, or, should the leader
    die meanwhile, once its own key has expired (``lease_ttl_s``) and the next oldest
    member has waited ``join_timeout_s``. Four lease TTLs cover two leaders in a row.
    """
    return max(MIN_FENCE_TTL_S, 4 * config.lease_ttl_s + config.join_timeout_s
               + config.settle_s)


@dataclass(frozen=True)
class FenceOutcome:
    """What :func:`fence_member` managed to do (each part is best effort)."""

    member_id: str
    recorded: bool  # the fence record, the event and the member key deletion went through
    revoked: bool  # the member lease was revoked


def fence_member(coord: Coordinator, cause: int, detail: str,
                 generation: int = 0) -> FenceOutcome:
    """Take ``coord``'s member out of its job for good; see the module docstring.

    ``coord`` is closed on return: the process is expected to exit.
    """
    member, lease, keys, run = coord.member_id, coord.lease_id, coord.keys, coord.run
    try:
        coord.close(leave=False)  # no graceful-leave record: this is a failure, not a leave
    except Exception as exc:  # closing must not stop the fence itself
        log.warning("closing the coordinator before fencing failed: %s", exc)
    if keys is None or run is None or not member:
        return FenceOutcome(member, False, False)
    now = time.time()
    fence = FenceRecord(member_id=member, cause=cause, detail=detail[:1000], unix=now,
                        generation=generation)
    event = EventRecord(kind=EVENT_KINDS.get(cause, "fenced"), member_id=member,
                        generation=generation, detail=detail[:1000], unix=now)
    recorded = revoked = False
    try:
        fence_lease = coord.client.grant(fence_ttl_s(coord.config))
    except Exception as exc:  # best effort: the run lease still ends it with the run
        log.warning("no lease for the fence record of %s (%s); it lives as long as the run",
                    member, exc)
        fence_lease = run.lease_id
    try:
        coord.client.txn([], [
            Txn.put(keys.fenced(member), encode(fence), fence_lease),
            Txn.put(keys.event(member), encode(event), run.lease_id),
            Txn.delete(keys.member(member)),
        ])
        recorded = True
    except Exception as exc:  # best effort: the process exits next
        log.error("could not record that %s fenced itself: %s", member, exc)
    if lease:
        try:
            revoked = coord.client.revoke(lease)
        except Exception as exc:  # best effort: the process exits next
            log.error("could not revoke the lease of %s: %s", member, exc)
    log.warning("member %s fenced itself (%s): %s", member, EVENT_KINDS.get(cause, cause),
                detail)
    return FenceOutcome(member, recorded, revoked)
