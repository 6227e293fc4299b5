"""torch's default process group, re-formed for each generation.

:class:`GroupManager` is the only code that creates or destroys torch's default process
group. For a generation it waits until every roster member acknowledged it (so nobody
waits for a peer the leader is about to drop), passes the rendezvous' commit point
(:mod:`peer_elastic.torch.barrier`), then runs ``init_process_group`` over an
:class:`~peer_elastic.torch.store.EtcdStore` under that generation's key prefix. Before
the commit point a rendezvous gives up as soon as the generation is superseded, and the
manager moves on to the newer one; after it, every member forms the group (a superseded
one is left at the next check), and gives up only when it can never complete: a member's
lease is gone, the job is done, or this peer's registration changed. Giving up after
publishing an address would leave the peers that read it connecting to a rank that left.
A member that dies there anyway leaves its peers waiting inside gloo; once the group can
never complete (the member's lease is gone, or its probe port refuses), each rank's
:class:`~peer_elastic.torch.gloo.stranded_connect.FormingGuard` ends those waits, and a group
formed after that is discarded.

Before a rendezvous, while forming takes long and while a collective waits, it probes the
roster's group addresses (:mod:`peer_elastic.torch.reachability`).

It also remembers the connections each group opened, so that a collective stuck on a peer
whose lease is gone can be abandoned (:meth:`GroupManager.abandon`, driven by
:class:`~peer_elastic.torch.gloo.abort.HangWatchdog`, which asks
:func:`~peer_elastic.torch.lost_peer.lost_peer` when).

Plain ``torch.distributed`` calls and DDP in user code use the group unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Assignment
from peer_elastic.etcd.deaths import probeable
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.stop import (
    ABANDON_RENDEZVOUS,
    CANNOT_COMPLETE,
    GroupId,
    MembershipFacts,
    StopCause,
    stop_reason,
)
from peer_elastic.etcd.view import JobView
from peer_elastic.observer import PeerStats
from peer_elastic.process.parent_only_sockets import ParentOnlySockets
from peer_elastic.process.sockets import keep_from_exec
from peer_elastic.records import JobConfig, RunRecord
from peer_elastic.torch.barrier import Arrival, pass_barrier
from peer_elastic.torch.formed_group import FormedGroup
from peer_elastic.torch.gloo.abort import GroupConnections, Loss, endpoint_matcher
from peer_elastic.torch.gloo.gloo_records import GlooListeners
from peer_elastic.torch.gloo.held_connections import HeldConnections
from peer_elastic.torch.gloo.retired_groups import RetiredGroups
from peer_elastic.torch.gloo.stranded_connect import FormingGuard
from peer_elastic.torch.gloo.subgroup_timeout import (
    bound_default_timeouts,
    restore_default_timeouts,
)
from peer_elastic.torch.lost_peer import lost_peer
from peer_elastic.torch.reachability import Reachability, ReachCoordinator
from peer_elastic.torch.store import EtcdStore

log = logging.getLogger(__name__)


#: Changes the default group's timeout after it formed (torch 2.x; private, hence looked up).
_SET_GROUP_TIMEOUT = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
#: How long an abandoned group's connections keep room for gloo's queued sends before they
#: are shut (GroupConnections.make_room): gloo's loop hands them over within milliseconds.
_FLUSH_BEFORE_CUT_S = 0.2
#: How often a peer waiting to be listed re-checks its own advertised address.
_ADDRESS_RECHECK_S = 1.0


def resolve_backend(backend: str) -> str:
    """``auto`` is nccl when CUDA is usable, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors that mean "the group broke" rather than "the user's code is wrong"."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(s in text for s in (
            "gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer",
            "Broken pipe", "Timed out waiting", "Socket Timeout", "ProcessGroup",
            "process group", "Application timeout caused pair closure",
        ))
    return False


def known_groups() -> list[object]:
    """The default group and every subgroup made in it (``dist.new_group``, a library's
    sharding groups): all that ``destroy_process_group()`` destroys. torch lists them only
    in a private map, hence looked up; the default group alone where it is missing."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or ())
    default = dist.group.WORLD
    return groups if default in groups else [default, *groups]


def destroy_default_group(connections: GroupConnections) -> int:
    """Destroy torch's default process group and shut down what it leaves open.

    ``destroy_process_group`` closes gloo's connections only when the group object dies,
    and something usually keeps it alive: the manager itself for a while
    (:mod:`peer_elastic.torch.gloo.retired_groups`), and a DDP wrapper (rebuilt in a reset
    callback, the README's recipe) holds its group in its reducer. A peer blocked in that
    group's collective waiting on this one would then wait for the collective timeout
    instead of failing at once, as it does when this process's end of the connection
    closes; and this process's own collectives in flight there would not end. So every
    connection the group opened (``connections``, captured at init) that is still open
    afterwards is shut down; returns how many were.
    """
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a broken group may complain while closing
        log.debug("destroying process group: %s", exc)
    return connections.cut()


class GroupCoordinator(MembershipFacts, ReachCoordinator, Protocol):
    """What :class:`GroupManager` uses of the coordinator: the run it forms groups in, the
    waits for a generation, and the watched view (with what :class:`Reachability` and
    :func:`lost_peer` read)."""

    client: EtcdClient  # the rendezvous' store; its endpoints are not a group's connections
    config: JobConfig
    run: RunRecord | None  # None before this peer registers
    keys: RunKeys | None
    view: JobView

    def hold_rejoin(self, until: Callable[[], bool] | None) -> None: ...

    def wait_generation(self, after: int = 0, timeout: float | None = None) -> Assignment: ...

    def wait_ready(self, generation: int, timeout: float | None = None) -> bool: ...


class GroupManager:
    """Forms torch's default process group for each generation; see the module docstring."""

    def __init__(
        self,
        coordinator: GroupCoordinator,
        backend: str = "auto",
        collective_timeout_s: float = 30.0,
        rendezvous_timeout_s: float = 120.0,
        *,
        stats: PeerStats | None = None,
    ) -> None:
        # gloo bounds its rendezvous waits by the group timeout (collective_timeout_s); the
        # store's own timeout bounds plain gets. Both end early when the generation is
        # superseded, through the store's abort check.
        self.coordinator = coordinator
        self.stats = stats if stats is not None else PeerStats()
        self.backend = resolve_backend(backend)
        self.collective_timeout_s = collective_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        # Groups the training script makes without a timeout get ours, not torch's 30 min.
        self._torch_defaults = bound_default_timeouts(collective_timeout_s)
        self.current: FormedGroup | None = None
        self.attempts = 0
        self._store: EtcdStore | None = None
        self._connections = GroupConnections()
        # This peer's gloo sockets, and the connections its abandons hold, are kept from the
        # processes it forks (DataLoader workers): a child must not keep them open once this
        # peer dies (peer_elastic.process.parent_only_sockets).
        self._parent_only = ParentOnlySockets()
        # A group made since the last close-on-exec marking (keep_connections_from_exec).
        self._unmarked = False
        # The gloo listeners of the current generation's groups, subgroups made at any time
        # in it included: their connections are cut with the group (_group_connections).
        self._listeners = self._new_listeners()
        self._lock = threading.Lock()  # current / _connections vs. the watchdog thread
        self._retired = RetiredGroups()  # destroyed groups, still referenced (why: there)
        self._held = HeldConnections()  # abandoned groups' connections, kept open (why: there)
        # Probes of the roster's group addresses: before a rendezvous, while forming takes
        # long, and while a collective waits (the hang monitor tells waited_on_peers).
        self.reach = Reachability(coordinator, collective_timeout_s, self._join_timeout_s,
                                  lambda: self.current)
        self._is_etcd = endpoint_matcher((e.host, e.port) for e in coordinator.client.endpoints)
        coordinator.hold_rejoin(self.left_lost_registration)

    def destroy(self) -> None:
        """Tear down the current group (if any). Safe after a failed collective or init."""
        with self._lock:
            had_group, self.current = self.current is not None, None
            # An abandoned group's connections stay as its abandon left them: open.
            connections = self._group_connections().without(self._held.inodes())
            self._connections = GroupConnections()
            self._listeners = self._new_listeners()
        if had_group:
            self.coordinator.view.wake()  # the watchdog looks at the current group
        if dist.is_initialized():
            # Kept a generation longer, so that no DDP reducer frees one holding the GIL:
            # subgroups too, which a user's DDP wrapper may reduce over.
            self._retired.retire(*known_groups())
            left_open = destroy_default_group(connections)
            log.debug("destroyed the process group; shut down its %d open connections",
                      left_open)
        else:
            # A failed init_process_group leaves torch's group counter advanced, and the
            # next rendezvous of this process would then use other keys than its peers
            # ("1//cpu//..." vs "0//cpu//..."). Only a successful destroy resets it.
            world = getattr(dist.distributed_c10d, "_world", None)
            if world is not None and hasattr(world, "group_count"):
                world.group_count = 0
        if self._store is not None:
            self._store.close()  # torch keeps only the C++ half alive; we held the rest
            self._store = None

    def close(self, wait_s: float = 10.0) -> None:
        """Destroy the current group and let go of every destroyed one (the peer is done
        with groups); waits at most ``wait_s`` for their collectives in flight to end."""
        self.destroy()
        self.coordinator.hold_rejoin(None)
        self.reach.close()
        self._retired.release(wait_s)
        self._held.release()
        self._parent_only.release()
        restore_default_timeouts(self._torch_defaults)

    def form(self, after: int) -> FormedGroup:
        """Join the newest generation after ``after`` that lists this peer.

        Standbys block here until promoted. Raises what the coordinator raises (job
        finished, elastic timeout, ...).
        """
        self.destroy()
        coord = self.coordinator
        while True:
            self.attempts += 1
            t0 = time.monotonic()
            a = self._wait_listed(after)
            if not coord.wait_ready(a.generation):
                log.info("generation %d superseded before everyone acknowledged it", a.generation)
                continue
            t1 = time.monotonic()
            pending = GroupId(a.generation, a.roster, coord.incarnation)
            if not self.reach.wait_reachable(a, lambda p=pending: self._abort_reason(p)) \
                    or not self._commit(a, pending):
                continue
            group = self._form_committed(a, pending, acks_s=t1 - t0, t1=t1)
            if group is not None:
                return group

    def _form_committed(self, a: Assignment, pending: GroupId, acks_s: float,
                        t1: float) -> FormedGroup | None:
        """Form ``a``'s group once this peer passed its commit point; None when it failed or
        was discarded (the caller forms the next generation)."""
        coord = self.coordinator
        # gloo: a member gone mid-connect must not strand this rank in gloo's wait for it.
        guard = FormingGuard(
            a.rank, a.size, lambda: self._abort_reason(pending, CANNOT_COMPLETE),
            coord.view, self._is_etcd, grace_s=self._join_timeout_s(),
            on_stuck=lambda: self.reach.why_forming_is_stuck(a),
        ) if self.backend == "gloo" else None
        listeners = self._new_listeners()

        def saw_value(key: str, value: bytes) -> None:
            listeners.saw_value(key, value)
            if guard is not None:
                guard.saw_value(key, value)

        assert coord.keys is not None
        store = self._store = self._new_store(
            pending, coord.keys.store_prefix(a.generation), CANNOT_COMPLETE,
            on_value=saw_value if self.backend == "gloo" else None)
        try:
            with guard or contextlib.nullcontext():
                connections = self._init_process_group(a, store)
        except Exception as exc:
            reason = self._abort_reason(pending)
            log.info("forming generation %d failed (%s): %s", a.generation,
                     reason or "error", exc)
            self.destroy()
            coord.check()
            if reason is None and not is_collective_failure(exc):
                raise
            if reason is None:
                # Our peers are gone but the leader has not noticed yet: tell it.
                coord.mark_broken(a.generation, f"rendezvous failed: {exc}")
            return None
        t2 = time.monotonic()
        snap = coord.snapshot()
        probes = tuple(probeable(snap, coord.member_id, [
            m for i in a.roster if (m := snap.members.get(i)) is not None]))
        with self._lock:
            self.current = FormedGroup(a, self.backend, t2, acks_s, t2 - t1, pending.incarnation,
                                       probes)
            self._connections, self._listeners = connections, listeners
        if guard is not None and guard.fired is not None:
            # Formed only because the guard handed gloo closed sockets: broken.
            log.info("generation %d formed after its guard acted (%s): discarded",
                     a.generation, guard.fired)
            self.destroy()
            coord.check()
            return None
        coord.view.wake()
        # Before the sync and the reset callbacks: a program one of them starts must not
        # hold the group's connections either (the callbacks' subgroups: Peer._reset).
        self.keep_connections_from_exec()
        log.info("formed generation %d: rank %d of %d (acks %.3f s, init %.3f s)",
                 a.generation, a.rank, a.size, acks_s, t2 - t1)
        return self.current

    def _init_process_group(self, a: Assignment, store: EtcdStore) -> GroupConnections:
        """``init_process_group`` for ``a`` over ``store``, under the formation timeout
        (:meth:`init_timeout_s`), then the collective timeout; the connections it opened."""
        init_timeout_s = self.init_timeout_s(a.size)
        with GroupConnections.capture(exclude=self._is_etcd) as connections:
            dist.init_process_group(
                self.backend, store=store, rank=a.rank, world_size=a.size,
                timeout=timedelta(seconds=init_timeout_s),
            )
            if init_timeout_s < self.collective_timeout_s:
                assert _SET_GROUP_TIMEOUT is not None  # else init_timeout_s is that
                _SET_GROUP_TIMEOUT(timedelta(seconds=self.collective_timeout_s))
        return connections

    def _wait_listed(self, after: int) -> Assignment:
        """``coordinator.wait_generation(after)``, re-checking this peer's own address while
        it waits (:meth:`Reachability.check_own_address`)."""
        while True:
            self.reach.check_own_address(self.coordinator.snapshot())
            try:
                return self.coordinator.wait_generation(after=after,
                                                        timeout=_ADDRESS_RECHECK_S)
            except TimeoutError:
                continue

    def init_timeout_s(self, size: int) -> float:
        """The group timeout while ``init_process_group`` connects ``size`` ranks.

        Past the commit point every member is on its way into the rendezvous, so its waits
        and connections take milliseconds among live peers. A member killed in the middle
        leaves the others waiting inside gloo, out of reach, for five times the group timeout
        (measured on torch 2.13: 150 s at the default 30 s). The formation guard
        (:mod:`peer_elastic.torch.gloo.stranded_connect`) frees them once the group can never
        complete; as a backstop for when it cannot, the group is formed with this shorter
        timeout and given the collective timeout once formed: at least 5 s and
        four times ``join_timeout_s`` (how long a peer may stay silent before it counts as
        lost), plus 20 ms per rank (each rank reads every other rank's address from etcd,
        one round trip each, before it has connected to all). Never more than the
        collective timeout. Under nccl (which connects at the first collective, and whose
        timeout also drives its watchdog), and where torch cannot change a group's timeout
        afterwards, it is the collective timeout throughout.
        """
        if _SET_GROUP_TIMEOUT is None or self.backend != "gloo":
            return self.collective_timeout_s
        return min(self.collective_timeout_s,
                   max(5.0, 4 * self._join_timeout_s()) + 0.02 * size)

    def _join_timeout_s(self) -> float:
        """How long a member may stay silent before it counts as lost."""
        return float(self.coordinator.config.join_timeout_s or 1.0)

    def left_lost_registration(self) -> bool:
        """Whether this peer is in no group formed under a registration it has lost.

        The coordinator registers again after a lost lease only then. A training thread can
        stay in the old group's collective long after the others dropped this peer (gloo
        never wakes a send queued on a connection cut meanwhile: it waits out its group's
        timeout), and listed again meanwhile, this peer would make the others wait for it
        in their next rendezvous. Reads memory only; :meth:`destroy` wakes the view.
        """
        group = self.current
        return group is None or group.incarnation == self.coordinator.incarnation

    # -- what the hang watchdog (peer_elastic.torch.gloo.abort.WatchedGroups) asks -------------------

    def current_group(self) -> FormedGroup | None:
        """The group this peer is in now (None between groups)."""
        return self.current

    def lost_peer(self, group: FormedGroup) -> Loss | None:
        """Why ``group`` can no longer complete a collective, or None while it can
        (:func:`peer_elastic.torch.lost_peer.lost_peer`)."""
        return lost_peer(self.coordinator, group, self._join_timeout_s())

    @property
    def has_unmarked_connections(self) -> bool:
        """A group was made in this generation since :meth:`keep_connections_from_exec`
        last ran (a subgroup of the training function): cheap enough for every check."""
        return self._unmarked

    def keep_connections_from_exec(self) -> int:
        """Mark the current generation's gloo connections close-on-exec (gloo opens them
        without), subgroups made so far included; how many. Forked children are handled
        apart (peer_elastic.process.parent_only_sockets); a program run by ``os.system`` or
        ``posix_spawn`` gets no Python between fork and exec, and would hold them open
        for as long as it runs."""
        self._unmarked = False  # first: a group made during the scan marks it again
        with self._lock:
            connections = self._group_connections()
        return keep_from_exec(connections.inodes)

    def abandon(self, group: FormedGroup, why: str) -> bool:
        """Make every pending and later collective of ``group`` fail now on this rank (the
        other ranks abandon it by themselves). No-op unless ``group`` is still the current
        one."""
        with self._lock:
            if group is not self.current:
                return False
            connections = self._group_connections()
        n = group.assignment.generation
        log.warning("abandoning generation %d's collectives: %s", n, why)
        if self.backend == "nccl":
            # nccl aborts for real (ncclCommAbort), each group its own communicators: the
            # default group and every subgroup made in it. gloo's abort() does not wake a
            # blocked receive, hence the connections below. Not exercised by the CPU suite.
            try:
                for pg in known_groups():
                    pg.abort()  # type: ignore[attr-defined]
            except Exception as exc:
                log.warning("could not abort generation %d's nccl groups: %s", n, exc)
                return False
        else:
            connections.make_room(_FLUSH_BEFORE_CUT_S)
            with self._lock:  # a teardown meanwhile (destroy) must find them held, or do it
                if group is not self.current:
                    return False  # the training thread left it; its teardown cut it
                held = connections.shut_for_reading()
                self._held.hold(held)
                self._parent_only.set(inodes=self._held.inodes())
            if not held:
                log.warning("%s, but generation %d has no connection left to cut; its "
                            "collectives end at the collective timeout (%.0f s)", why, n,
                            self.collective_timeout_s)
                return False
        self.stats.collective_abandoned()
        self.coordinator.record_event("collective abandoned", why, generation=n)
        return True

    def _commit(self, a: Assignment, pending: GroupId) -> bool:
        """Pass the commit point of ``a``'s rendezvous; False when this peer withdrew
        (superseded, or not everyone arrived in time): form the next generation."""
        coord = self.coordinator
        assert coord.keys is not None
        with self._new_store(pending, coord.keys.arrivals_prefix(a.generation),
                             ABANDON_RENDEZVOUS) as store:
            result = pass_barrier(store, coord.member_id, a.roster,
                                  timedelta(seconds=self.rendezvous_timeout_s))
        if result.arrival is Arrival.COMMITTED:
            return True
        log.info("withdrew from generation %d's rendezvous: %s", a.generation, result.detail)
        if result.arrival is Arrival.TIMED_OUT:
            self.coordinator.mark_broken(a.generation, f"rendezvous: {result.detail}")
        return False

    def _new_listeners(self) -> GlooListeners:
        """Listeners whose addresses, and so every connection to or from them, a forked
        child does not keep; a new set replaces the last one's."""
        self._parent_only.set(addresses=())
        return GlooListeners(on_change=self._listeners_changed)

    def _listeners_changed(self, seen: frozenset[tuple[str, int]]) -> None:
        self._parent_only.set(addresses=seen)
        self._unmarked = True

    def _group_connections(self) -> GroupConnections:
        """The current generation's connections: those captured while its group formed, and
        any open now to or from a listener of a group made in it since (subgroups, made in
        reset callbacks or in the training function). Under ``_lock``."""
        return self._connections.merged(
            GroupConnections.touching(self._listeners.addresses()))

    def _new_store(self, pending: GroupId, prefix: str, give_up_on: Collection[StopCause],
                   on_value: Callable[[str, bytes], None] | None = None) -> EtcdStore:
        coord = self.coordinator
        assert coord.run is not None
        return EtcdStore(
            coord.client,
            prefix,
            lease_id=coord.run.lease_id,
            timeout=timedelta(seconds=self.rendezvous_timeout_s),
            abort=lambda: self._abort_reason(pending, give_up_on),
            on_value=on_value,
        )

    def _abort_reason(self, pending: GroupId,
                      causes: Collection[StopCause] = ABANDON_RENDEZVOUS) -> str | None:
        """Why the rendezvous of ``pending`` should give up, or None while it may go on."""
        reason = stop_reason(self.coordinator, pending, causes=causes)
        return None if reason is None else reason.detail

