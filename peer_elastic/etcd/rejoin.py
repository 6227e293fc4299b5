"""A member lease lost, and what follows: :class:`Rejoin`.

A peer's member lease is lost when its keeper says so (a refresh refused, or none answered
in time) or when its own member key leaves the watched view after the view had listed it
under this registration (the leader revoked it for silence, or it expired before the keeper
noticed). Then, on the coordination thread
(:class:`~peer_elastic.etcd.coordinator.Coordinator`):

1. the registration ends at once: its session is revoked and the coordinator's
   ``incarnation`` changes, so the training side stops using the groups formed under it
   (:data:`~peer_elastic.etcd.stop.StopCause.LEASE_LOST`). A peer that does not rejoin
   (``auto`` off) raises :class:`~peer_elastic.errors.LeaseLost` here;
2. the peer registers again, as a new member (a joiner), once the gate (:meth:`Rejoin.hold`)
   lets it: the training side's "my training thread has left every group formed under a lost
   registration". Listed earlier, it would make the others wait in their next rendezvous
   for a thread still stuck in an old collective.

A peer that loses lease after lease (a host too starved to refresh them: hundreds of
members of one process registering together) waits a growing, random while before each new
registration after the first (:func:`backoff_s`). Registering at once again would add the
very load that starved its leases, and every member of the host doing it together turns
overload into a rejoin storm that never settles; spread out, the registrations get through
and the job settles, later.

Nothing here touches etcd itself: the coordinator passes the two steps in.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable

from peer_elastic.errors import LeaseLost
from peer_elastic.etcd.counters import CoordinatorCounters

__all__ = ["Listing", "Rejoin", "backoff_s"]

log = logging.getLogger(__name__)

#: The longest wait of the second loss in a row; it doubles with each further loss ...
BACKOFF_BASE_S = 0.5
#: ... up to this.
BACKOFF_CAP_S = 16.0
#: A registration that lasted this long ends a run of losses: the next loss is a first.
STREAK_ENDS_AFTER_S = 60.0


def backoff_s(losses_in_a_row: int, rng: random.Random) -> float:
    """How long to wait before registering again after the ``losses_in_a_row``-th lost
    lease in a row: nothing after the first (a peer that stalled once comes back at once),
    then a random while up to 0.5 s, 1 s, 2 s, ... 16 s ("full jitter": peers that lost
    their leases together spread out instead of coming back together)."""
    if losses_in_a_row <= 1:
        return 0.0
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (losses_in_a_row - 2)))


class Listing(enum.Enum):
    """Whether the watched view lists this peer's current registration."""

    LISTED = "listed"
    NOT_YET = "not_yet"  # registered, but the view has not shown it yet
    GONE = "gone"  # listed under this registration before, gone now: the lease is lost


class Rejoin:
    """A lost member lease and the registration that replaces it; see the module docstring.

    ``counters.rejoins`` counts the registrations made after a lost lease.
    """

    def __init__(self, counters: CoordinatorCounters, wake: Callable[[], None],
                 auto: bool = True, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.auto = auto  # register again after a lost lease (else raise LeaseLost)
        self._counters = counters
        self._wake = wake  # wakes the coordination thread
        self._lost = threading.Event()
        self._gate: Callable[[], bool] | None = None
        self._listed_incarnation = -1  # the last incarnation the view has listed
        self._rng = rng or random.Random()
        self._clock = clock
        self._registered_at = clock()
        self._losses_in_a_row = 0
        self._not_before = 0.0  # clock() before which it does not register again

    @property
    def pending(self) -> bool:
        """A lost lease that no new registration has replaced yet."""
        return self._lost.is_set()

    def lease_lost(self, member_id: str, why: str) -> None:
        """The current registration's lease is gone (the caller wakes the coordination
        thread)."""
        log.warning("member %s lost its lease: %s", member_id, why)
        self._lost.set()

    def registered(self) -> None:
        """A new registration was adopted: no lost lease is pending any more."""
        self._lost.clear()
        self._registered_at = self._clock()

    def hold(self, until: Callable[[], bool] | None) -> None:
        """After a lost lease, register again only once ``until()`` holds (None: at once).

        It is asked on the coordination thread, under the view's lock, so it must only read
        memory; whoever makes it true wakes the view.
        """
        self._gate = until
        self._wake()

    def may_register(self) -> bool:
        """The backoff is over and the gate open. Asked at every tick of the coordination
        thread, so a backoff ends without anyone waking it."""
        if self._clock() < self._not_before:
            return False
        gate = self._gate
        return gate is None or gate()

    def due(self, registered: bool) -> bool:
        """A lost lease the coordination thread has yet to act on: end the (still
        ``registered``) registration, or register again now that the gate opened."""
        return self._lost.is_set() and (registered or self.may_register())

    def observe_listing(self, listed: bool, incarnation: int) -> Listing:
        """Note whether the view lists registration ``incarnation``'s member key.

        A key the view listed under this incarnation and no longer does means the lease is
        as good as lost, even if the keeper has not noticed yet: :attr:`pending` from now.
        """
        if listed:
            self._listed_incarnation = incarnation
            return Listing.LISTED
        if self._listed_incarnation == incarnation:
            self._lost.set()
            return Listing.GONE
        return Listing.NOT_YET

    def act(self, member_id: str, registered: bool, end_registration: Callable[[], None],
            register: Callable[[], str]) -> None:
        """Act on a pending lost lease: ``end_registration()`` (once: while ``registered``),
        then ``register()`` anew (it returns the new member id) when the gate lets us."""
        if registered:
            end_registration()
            if not self.auto:
                raise LeaseLost(f"member {member_id} lost its lease")
            now = self._clock()
            lasted = now - self._registered_at
            self._losses_in_a_row = (self._losses_in_a_row + 1
                                     if lasted < STREAK_ENDS_AFTER_S else 1)
            wait = backoff_s(self._losses_in_a_row, self._rng)
            self._not_before = now + wait
            if wait > 0:
                log.warning("member %s lost its lease %d times in a row; it registers again "
                            "in %.1f s", member_id, self._losses_in_a_row, wait)
            elif not self.may_register():
                log.warning("member %s lost its lease; it registers again once its training "
                            "thread has left the process group it was in", member_id)
        if not self.may_register():
            return  # woken again by the view when the training side leaves its group
        new_member_id = register()
        self._counters.rejoins += 1
        log.warning("member %s re-registered as %s after losing its lease", member_id,
                    new_member_id)
