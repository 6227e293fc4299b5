"""Abandoning a collective that waits on a peer whose lease is gone.

A peer that hangs inside a collective (stopped, swapping, cut off by the network) leaves
every other rank blocked in that collective until the group's timeout, 30 s or more. Once
the hung peer's lease is gone the leader has already written a generation without it; the
survivors only have to get out of the collective they are stuck in.

gloo has no abort that does this: on torch 2.13 ``ProcessGroupGloo.abort()`` and
``shutdown()`` return at once but leave a blocked receive waiting out the full timeout.
What does end a blocked gloo operation at once is a failed connection. So
:class:`GroupConnections` remembers the TCP connections gloo opened while a group formed,
and :meth:`GroupConnections.cut` shuts them down (``shutdown(2)``, not ``close``: gloo still
owns the descriptors and closes them when the group is destroyed). Every pending and later
operation of that group then raises "Connection closed by peer" on this rank, and on each
peer connected to it, which the run loop already handles as a failed collective: restore
the last commit and re-form. An abandon ends only this rank's side instead
(:meth:`GroupConnections.shut_for_reading`) and holds the connections open, so that nothing
reaches a frozen peer (:mod:`peer_elastic.torch.gloo.held_connections` says why). nccl has a
real abort, which the group manager uses.

:class:`HangWatchdog` decides when: a member of the group this peer trains in has lost its
lease (its key is gone from the watched view), or is cut off from the others' groups (the
reachability reports of :mod:`peer_elastic.etcd.reach`, which a long wait in a collective
triggers), or this peer itself lost its lease. It first
gives the training thread a grace (:class:`Loss`) to leave the group on its own, at its next
``check_host_updates()``, so a step that is merely in progress is never thrown away; only a
group that is still current after the grace is cut. (No grace where it cannot help, when
this peer lost its own lease; a short one when every lost member's probe port refuses, its
process gone.) Subgroups made at any time in the
generation (``dist.new_group`` in a reset callback or in the training function, a device
mesh, DDP over a subgroup) are cut with their group: every gloo group publishes its
listeners' addresses through the generation's store, and :meth:`GroupConnections.touching`
finds the connections to and from those listeners.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from peer_elastic.process import threads
from peer_elastic.process.netaddr import plain_ip
from peer_elastic.process.sockets import open_socket, socket_inodes, tcp_ends

log = logging.getLogger(__name__)


def _connections(skip: Collection[int] = (),
                 ) -> Iterator[tuple[int, tuple[str, int], tuple[str, int]]]:
    """``(inode, remote (plain ip, port), local (plain ip, port))`` of each connected TCP
    socket of this process whose inode is not in ``skip``. Never a listener: shutting
    gloo's listener down kills the process (its accept loop treats the error as fatal)."""
    for inode, fd in socket_inodes().items():
        if inode in skip:
            continue
        local, remote = tcp_ends(fd, inode)
        if local is not None and remote is not None:
            yield inode, remote, local


class GroupConnections:
    """The TCP connections one process group opened, remembered so they can be cut.

    Use :meth:`capture` around ``init_process_group``: connections that appear during the
    block and lead anywhere but ``exclude`` (the etcd endpoints, whose client may reconnect
    meanwhile) belong to the group. gloo connects its full mesh during init, unless
    ``TORCH_GLOO_LAZY_INIT`` is set; then nothing is captured and a hang waits for the
    collective timeout, as without this class.
    """

    def __init__(self, inodes: Iterable[int] = ()) -> None:
        self.inodes = frozenset(inodes)

    @classmethod
    @contextlib.contextmanager
    def capture(cls, exclude: Callable[[str, int], bool] = lambda host, port: False,
                ) -> Iterator[GroupConnections]:
        found = cls()
        before = socket_inodes()
        yield found
        found.inodes = cls.opened_since(before, exclude).inodes

    @classmethod
    def opened_since(cls, before: dict[int, int],
                     exclude: Callable[[str, int], bool]) -> GroupConnections:
        """The connections open now that were not in ``before`` (a :func:`socket_inodes`)
        and lead anywhere but ``exclude``; listeners are never included."""
        return cls(inode for inode, peer, _ in _connections(skip=before)
                   if not exclude(*peer))

    @classmethod
    def touching(cls, endpoints: Collection[tuple[str, int]]) -> GroupConnections:
        """The connections open now whose local or remote end is one of ``endpoints``
        (plain ip, port): gloo's listeners (:class:`~peer_elastic.torch.gloo.gloo_records.
        GlooListeners`). A connection accepted by a listener has the listener's address
        as its local end; one made to it, as its remote end. Listeners are not included."""
        if not endpoints:
            return cls()
        return cls(inode for inode, peer, local in _connections()
                   if peer in endpoints or local in endpoints)

    def merged(self, other: GroupConnections) -> GroupConnections:
        """These connections and ``other``'s (a group's subgroups made after it formed)."""
        return GroupConnections(self.inodes | other.inodes)

    def cut(self, flush_s: float = 0.0) -> int:
        """Shut down every remembered connection that is still open; return how many.

        With ``flush_s``, each connection first gets room for whatever gloo still has
        queued for it, and the shutdown follows ``flush_s`` later. Why: gloo sizes a
        socket's send buffer by the first message (a few KB), so on a link that stopped
        acknowledging, a send soon no longer fits and waits in the pair's queue for the
        socket to take it; and gloo's ``Pair::signalException`` wakes every pending
        operation except such a queued unbound-buffer send, which then waits out the group
        timeout however its connection ends (seen on three hosts: one peer of the cut's
        healthy side stuck in "Timed out waiting ... for send operation to complete").
        A larger send buffer wakes gloo's loop, which hands the kernel the rest; the send
        completes here (its bytes never arrive), and the collective fails at its next step
        on the shut connections.
        """
        if flush_s > 0:
            self.make_room(flush_s)
        count = 0
        for sock in self._open():
            with sock:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
                except OSError:  # already reset by the other side
                    pass
        return count

    def make_room(self, settle_s: float) -> None:
        """Give every remembered connection room for whatever gloo still has queued for it,
        and wait ``settle_s`` for gloo's loop to hand it to the kernel (why: :meth:`cut`)."""
        for sock in self._open():
            with sock:
                _grow_send_buffer(sock)
        time.sleep(settle_s)

    def shut_for_reading(self) -> list[socket.socket]:
        """End this rank's pending and later operations on every remembered connection
        still open, and tell the other end nothing; return a duplicate of each connection
        shut, which keeps it established (hold them: :mod:`peer_elastic.torch.gloo.held_connections`
        says why).

        ``shutdown(SHUT_RD)`` makes gloo's loop read end-of-file: it fails the pair's waits
        and closes its own descriptor, and no FIN or reset leaves. Call :meth:`make_room`
        first where gloo may have sends queued."""
        held = []
        for sock in self._open():
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:  # already reset by the other side: nothing to hold
                sock.close()
                continue
            held.append(sock)
        return held

    def without(self, inodes: Collection[int]) -> GroupConnections:
        """These connections but ``inodes``."""
        return GroupConnections(self.inodes - frozenset(inodes))

    def _open(self) -> Iterator[socket.socket]:
        """A duplicate of each remembered connection still open (the caller closes it)."""
        by_inode = socket_inodes()
        for inode in self.inodes:
            fd = by_inode.get(inode)
            if fd is not None and (sock := open_socket(fd, inode)) is not None:
                yield sock


#: The send buffer a connection gets before it is cut (see GroupConnections.cut).
_ROOM_BYTES = 64 * 1024 * 1024
#: SO_SNDBUFFORCE (Linux, asm-generic/socket.h): Python's socket module does not name it.
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32 if sys.platform == "linux" else None)


def _grow_send_buffer(sock: socket.socket) -> None:
    """Grow ``sock``'s send buffer: beyond ``net.core.wmem_max`` where this process may
    (SO_SNDBUFFORCE, CAP_NET_ADMIN), else up to it."""
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        if option is None:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _ROOM_BYTES)
            return
        except OSError:  # not permitted, or the connection is gone already
            continue


def endpoint_matcher(endpoints: Iterable[tuple[str, int]]) -> Callable[[str, int], bool]:
    """A predicate that is true for the addresses the given ``(host, port)`` resolve to."""
    addresses: set[tuple[str, int]] = set()
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            addresses.add((str(info[4][0]), port))

    def match(host: str, port: int) -> bool:
        # plain_ip: an IPv4 peer on a dual-stack socket shows as ::ffff:a.b.c.d
        return (host, port) in addresses or (plain_ip(host), port) in addresses

    return match


G = TypeVar("G")


@dataclass(frozen=True)
class Loss:
    """Why a watched group can no longer complete a collective."""

    why: str  # for logs and events
    grace_s: float  # how long the training thread may take to leave the group by itself


class WatchedGroups(Protocol[G]):
    """The groups a :class:`HangWatchdog` watches (``GroupManager`` is one)."""

    def current_group(self) -> G | None:
        """The group this peer is in (None between groups)."""

    def lost_peer(self, group: G) -> Loss | None:
        """Why ``group`` can no longer complete a collective, or None while it can."""

    def abandon(self, group: G, why: str) -> bool:
        """Make ``group``'s pending and later collectives fail now."""


class Changes(Protocol):
    """Wake-ups on membership changes (the job view is one): ``wait_change`` returns on a
    new version, when ``until()`` holds after a :meth:`wake`, or at ``timeout``."""

    def wait_change(self, version: int, timeout: float,
                    until: Callable[[], bool] | None = None) -> int: ...

    def wake(self) -> None: ...


class HangWatchdog(Generic[G]):
    """Frees this peer from a collective that waits on a peer whose lease is gone.

    It watches ``groups`` (:class:`WatchedGroups`): when the current group lost a peer and
    is still current the :class:`Loss`'s grace later, it abandons the group's collectives.
    It waits on ``changes`` (the job view), so it wakes on membership changes and on
    ``wake()``, which the group manager calls whenever its group changes; it never polls.
    """

    def __init__(self, groups: WatchedGroups[G], changes: Changes) -> None:
        self._groups = groups
        self._current = groups.current_group
        self._wait_change = changes.wait_change
        self._wake = changes.wake
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.aborted = 0

    def start(self) -> HangWatchdog[G]:
        if self._thread is None:
            self._thread = threads.start(self._watch_loop, "hang-watchdog")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch_loop(self) -> None:
        version = -1
        seen: G | None = None
        while not self._stop.is_set():
            group = self._current()
            loss = self._groups.lost_peer(group) if group is not None else None
            if loss is not None:
                self._handle(group, loss)
            seen = group
            # Membership changes bump the view's version; group changes arrive by wake().
            version = self._wait_change(
                version, 5.0, lambda s=seen: self._stop.is_set() or self._current() is not s)

    def _handle(self, group: G, loss: Loss) -> None:
        """Give the training thread the grace to leave ``group``; cut it if it did not."""
        grace = loss.grace_s
        log.info("%s: the group is abandoned unless this peer leaves it within %.1f s",
                 loss.why, grace)
        deadline = time.monotonic() + grace
        version = -1
        while not self._stop.is_set() and self._current() is group:
            left = deadline - time.monotonic()
            if left <= 0:
                self.aborted += 1
                self._groups.abandon(group, loss.why)
                break
            version = self._wait_change(
                version, left, lambda: self._stop.is_set() or self._current() is not group)
        # Once cut (or left), wait for the group to change before judging again.
        while not self._stop.is_set() and self._current() is group:
            version = self._wait_change(
                version, 5.0, lambda: self._stop.is_set() or self._current() is not group)

