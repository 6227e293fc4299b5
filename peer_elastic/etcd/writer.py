"""What one registered member writes into its run: acks, events, and the leader's writes.

:class:`RunWriter` is bound to one registration (a member id, its run and the run lease); a
member that re-registers gets a new one. It performs what :class:`~peer_elastic.etcd.leader.
Leader` decides (it is the leader's :class:`~peer_elastic.etcd.leader.LeaderWrites`), so the
decisions can be tested against a fake writer, and these writes against a real etcd.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from peer_elastic.errors import EtcdError
from peer_elastic.etcd.acks import batcher_for
from peer_elastic.etcd.client import EtcdClient, Txn
from peer_elastic.etcd.done import write_done
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.roster import GenerationPlan
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.records import (
    AckRecord,
    DoneRecord,
    DrainRecord,
    EventRecord,
    GenerationRecord,
    HostRecord,
    ProgressRecord,
    ReachRecord,
    StateRecord,
    encode,
)

log = logging.getLogger(__name__)


class AckKind(enum.Enum):
    """The acknowledgements a member gives of a generation (see :mod:`~peer_elastic.etcd.keys`)."""

    READY = "ready"  # it saw the generation (proof of life)
    ALIVE = "alive"  # it saw the generation break, and lives
    BROKEN = "broken"  # one of its collectives in the generation failed


class Written(enum.Enum):
    """How a compare-and-swap of the generation record ended."""

    WRITTEN = "written"  # ours is the new generation
    LOST = "lost"  # another writer (or a change of the guards) won


@dataclass(frozen=True)
class EventsPruned:
    """What :meth:`RunWriter.prune_events` did: ``deleted`` events, and the etcd
    ``revision`` from which on a view of the job has seen that prune (its count is true)."""

    deleted: int
    revision: int


def holds(resp: list, data: bytes) -> bool:
    """Whether a failed transaction's read (``resp[0]``, one key) found exactly ``data``:
    a value this peer just encoded (it has a fresh id or time stamp), so its own write."""
    return bool(resp and resp[0] and resp[0][0].value == data)


class RunWriter:
    """Writes of member ``member_id`` into run ``keys`` (attached to ``run_lease``)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, run_lease: int, member_id: str) -> None:
        self.client = client
        self.keys = keys
        self.run_lease = run_lease
        self.member_id = member_id

    def etcd_settled_at(self) -> float:
        """When etcd may be taken as settled again after the last disruption we saw: a
        member whose request stalled on the disruption has failed over by then."""
        if not self.client.disrupted_at:
            return 0.0
        return self.client.disrupted_at + 2 * self.client.timeout_s

    def recheck_etcd_settled_at(self) -> float:
        """:meth:`etcd_settled_at` after one fresh read of etcd.

        The client hears of an etcd leader election only from a response (a new raft term
        in its header) or a failure of its own; a leader whose connection was unaffected
        and who sent nothing since may not know yet. The read tells it: it waits out an
        election still under way and answers with the new term, or fails (a disruption
        too). Asked before dropping a member for silence, which an election can fake.
        """
        try:
            self.client.get(self.keys.run_key)
        except EtcdError:
            pass  # the client noted the failure as a disruption
        return self.etcd_settled_at()

    # -- this member's own records ----------------------------------------------------------------

    def ack(self, kind: AckKind, generation: int, member_lease: int, detail: str = "") -> None:
        """Acknowledge ``generation`` under the member lease (it ends with the member).

        Written together with the acks other members sharing our client give at the same
        moment (:mod:`~peer_elastic.etcd.acks`): one transaction and one revision for all."""
        rec = AckRecord(member_id=self.member_id, generation=generation, unix=time.time(),
                        detail=detail)
        key = {AckKind.READY: self.keys.ready, AckKind.ALIVE: self.keys.alive,
               AckKind.BROKEN: self.keys.broken}[kind](generation, self.member_id)
        batcher_for(self.client).put(key, encode(rec), member_lease)

    def report_unreachable(self, members: Collection[str], generation: int,
                           member_lease: int) -> None:
        """Say which members this one cannot reach (:mod:`~peer_elastic.etcd.reach`), under
        the member lease (the report ends with the member)."""
        rec = ReachRecord(member_id=self.member_id, unreachable=sorted(members),
                          generation=generation, unix=time.time())
        self.client.put(self.keys.unreachable(self.member_id), encode(rec), member_lease)

    def clear_unreachable(self) -> None:
        """Every member this one reported answers again."""
        self.client.delete(self.keys.unreachable(self.member_id))

    def progress(self, rec: ProgressRecord) -> None:
        """Write the last committed position (``status`` shows it)."""
        self.client.put(self.keys.progress, encode(rec), self.run_lease)

    def state(self, commits: int, generation: int) -> None:
        """Say that the run's training state has ``commits`` commits (rank 0 writes it)."""
        rec = StateRecord(commits=commits, generation=generation, unix=time.time(),
                          written_by=self.member_id)
        self.client.put(self.keys.state, encode(rec), self.run_lease)

    def mark_leaving(self, generation: int) -> None:
        """Write our drain record with a "left" event before the member lease goes, so the
        leader takes the departure for a graceful leave (best effort)."""
        rec = DrainRecord(member_id=self.member_id, requested_by=self.member_id, unix=time.time())
        event = EventRecord(kind="left", member_id=self.member_id, unix=time.time(),
                            generation=generation)
        try:
            self.client.txn([], [
                Txn.put(self.keys.drain(self.member_id), encode(rec), self.run_lease),
                Txn.put(self.keys.event(self.member_id), encode(event), self.run_lease),
            ])
        except EtcdError as exc:
            log.debug("could not mark %s as leaving: %s", self.member_id, exc)

    # -- the event log ----------------------------------------------------------------------------

    def event(self, kind: str, detail: str = "", member_id: str | None = None,
              generation: int = 0, timings: Mapping[str, float] | None = None) -> None:
        """Append to the run's event log (best effort: a lost event is logged, not raised)."""
        rec = EventRecord(kind=kind, member_id=member_id or self.member_id, detail=detail,
                          unix=time.time(), generation=generation)
        rec.timings_s.update(timings or {})
        try:
            self.client.put(self.keys.event(self.member_id), encode(rec), self.run_lease)
        except EtcdError as exc:
            log.debug("event not recorded: %s", exc)

    def prune_events(self, keep: int) -> EventsPruned:
        """Delete the oldest events (keys sort by time) until at most ``keep`` remain.

        The excess is counted in etcd, not taken from the caller's view: a view that has not
        yet seen an earlier prune's deletes counts too many, and deleting by that count
        removed the newest events too (measured: the whole log, under load). The revision
        returned is read after the delete, so a view at it has seen the delete.
        """
        prefix = self.keys.events_prefix
        excess = self.client.count_prefix(prefix) - keep
        oldest = self.client.first_keys(prefix, excess) if excess > 0 else []
        if oldest:
            # Events written since the count are newer than every key deleted here.
            self.client.txn([], [Txn.delete_range(prefix, oldest[-1] + "\0")])
            log.info("event log: deleted the %d oldest events", len(oldest))
        return EventsPruned(deleted=len(oldest), revision=self.client.revision())

    # -- the end of the run -----------------------------------------------------------------------

    def write_done(self, success: bool, reason: str, cause: int, generation: int,
                   timeout_s: float | None = None) -> bool:
        """Record the end of the run (see :func:`~peer_elastic.etcd.done.write_done`)."""
        rec = DoneRecord(success=success, reason=reason, cause=cause, written_by=self.member_id,
                         unix=time.time(), generation=generation)
        return write_done(self.client, self.keys, self.run_lease, rec, timeout_s)

    # -- host failures ----------------------------------------------------------------------------

    def count_host_failure(self, host: str, member_id: str, count: int, mod_revision: int) -> None:
        """Set ``host``'s failure count to ``count`` (compare-and-swap on ``mod_revision``)."""
        rec = HostRecord(host=host, failures=count, unix=time.time(),
                         reason=f"member {member_id} failed")
        self.client.compare_and_put(self.keys.failures(host), encode(rec), mod_revision,
                                    self.run_lease)

    def blacklist_host(self, host: str, member_id: str, count: int, cooldown_s: float) -> None:
        """Exclude ``host`` for ``cooldown_s`` (its own lease) and reset its failure count."""
        rec = HostRecord(host=host, failures=count, unix=time.time(),
                         reason=f"member {member_id} failed")
        lease = self.client.grant(cooldown_s)
        self.client.txn([], [
            Txn.put(self.keys.blacklist(host), encode(rec), lease),
            Txn.delete(self.keys.failures(host)),
        ])

    # -- generations ------------------------------------------------------------------------------

    def write_generation(self, snap: ViewSnapshot, plan: GenerationPlan, detected_unix: float,
                         silent: Mapping[str, str] | None = None) -> Written:
        """Install ``plan`` over ``snap``'s generation (compare-and-swap), guarded: the writer
        is still a member, and every dropped member's missing ack is still missing.

        Raises :class:`EtcdRequestTooLarge` when etcd refuses the record as too large."""
        keys = self.keys
        rec = GenerationRecord(
            number=plan.number, roster=list(plan.roster), reason=plan.reason,
            written_by=self.member_id, written_unix=time.time(),
            joined=list(plan.joined), removed=list(plan.removed), detected_unix=detected_unix,
            causes=list(plan.causes),
        )
        # The ack each dropped member failed to give must still be absent: if it arrives
        # first, the drop is wrong and the write fails.
        n = plan.number - 1
        guards = [Txn.version(keys.alive(n, m) if (silent or {}).get(m) == "alive"
                              else keys.ready(n, m)) == 0 for m in plan.dropped]
        data = encode(rec)
        mod = snap.generation_mod_revision
        ok, resp = self.client.txn(
            [Txn.version(keys.generation) == 0 if mod == 0
             else Txn.mod(keys.generation) == mod,
             # Only a member writes: a leader whose lease ended after it decided (its
             # key is gone, others may already lead) must not install a roster.
             Txn.version(keys.member(self.member_id)) > 0,
             *guards],
            [Txn.put(keys.generation, data, self.run_lease), *self._generation_ops(snap, plan)],
            [Txn.get(keys.generation)],
        )
        if not ok and holds(resp, data):
            ok = True  # our write applied; the client retried it after losing the answer
        if not ok:
            log.debug("generation %d: another writer won", plan.number)
            return Written.LOST
        log.info("generation %d: %d members (%s)", plan.number, len(plan.roster), plan.reason)
        return Written.WRITTEN

    def _generation_ops(self, snap: ViewSnapshot, plan: GenerationPlan) -> list:
        """What goes into the generation's transaction besides the record itself."""
        keys = self.keys
        event = EventRecord(kind="generation", member_id=self.member_id, generation=plan.number,
                            detail=plan.reason, unix=time.time(), world_size=len(plan.roster),
                            causes=list(plan.causes))
        ops = [Txn.put(keys.event(self.member_id), encode(event), self.run_lease)]
        if plan.number >= 3:  # two behind: nobody can still be forming it
            ops.append(Txn.delete(keys.gen_prefix(plan.number - 2), prefix=True))
        # Dropped members' keys go in the same transaction: were they to outlive the new
        # generation by even one event, the next pass would see a live member outside the
        # roster and re-admit it as a newcomer. (Their leases are revoked right after.)
        ops += [Txn.delete(keys.member(m)) for m in plan.dropped]
        # Drain records of members already gone (bounded: etcd allows 128 ops per txn).
        ops += [Txn.delete(keys.drain(m)) for m in sorted(snap.drains)
                if m not in snap.members][:20]
        return ops

    def revoke(self, lease_id: int) -> None:
        """End a dropped member's lease (and whatever else is attached to it)."""
        self.client.revoke(lease_id)
