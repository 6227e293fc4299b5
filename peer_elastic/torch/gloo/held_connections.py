"""Connections of abandoned groups, held open for a while so that no reset reaches a frozen peer.

Why: when the survivors abandon a group whose member is frozen (SIGSTOP, swapping) or cut
off, anything that ends their side of its connections reaches that member: a FIN, and a
reset once gloo closes a socket with data unread or more data arrives. The member, woken,
resumes its gloo worker and its loop at once. A write of the worker that meets the reset
fails before the loop has read that the connection ended, and gloo queues a failed write as
if the socket were merely full; its error path wakes every wait of the pair except such a
queued send (``gloo/transport/tcp/pair.cc``, ``Pair::write``, ``Pair::signalException``).
The woken member then waited out the collective timeout before it could rejoin: in 7 of 27
stops of the test suite's SIGSTOP tests (5 of the 11 with DDP over a subgroup), none of 36
since.

So an abandon shuts its connections for reading only, which ends this rank's operations
(gloo reads end-of-file) and sends nothing, and keeps a duplicate of each, which keeps it
established after gloo closes its own descriptor. A member woken later writes into an open
connection, and its own hang watchdog ends its collective (it finds its lease gone).

This holds the duplicates of the last few abandons (:data:`KEEP_ABANDONS`) and closes older
ones, so the descriptors held stay bounded however many abandons a long job sees; a member
frozen through that many more abandons meets the reset again, and at worst the timeout.
:meth:`HeldConnections.release` closes them all (the peer is done with groups).

One job: hold sockets, then close them. It shuts nothing down itself.
"""

from __future__ import annotations

import collections
import os
import socket
import threading

__all__ = ["KEEP_ABANDONS", "HeldConnections"]

#: How many abandons' connections are held at once.
KEEP_ABANDONS = 2


class HeldConnections:
    """Duplicates of abandoned connections, per abandon, the newest :data:`KEEP_ABANDONS`."""

    def __init__(self, keep: int = KEEP_ABANDONS) -> None:
        if keep < 1:
            raise ValueError(f"keep at least one abandon's connections, not {keep}")
        self._abandons: collections.deque[list[socket.socket]] = collections.deque()
        self._keep = keep
        self._lock = threading.Lock()  # the watchdog adds, the training thread reads

    def hold(self, sockets: list[socket.socket]) -> None:
        """Hold ``sockets`` (one abandon's); close those of abandons beyond the newest kept."""
        with self._lock:
            self._abandons.append(list(sockets))
            older = [self._abandons.popleft() for _ in range(len(self._abandons) - self._keep)]
        for abandon in older:
            _close_all(abandon)

    def inodes(self) -> frozenset[int]:
        """The socket inodes held (so that tearing a group down leaves them be)."""
        with self._lock:
            held = [sock for abandon in self._abandons for sock in abandon]
        found = set()
        for sock in held:
            try:
                found.add(_inode(sock))
            except OSError:  # closed meanwhile by release()
                continue
        return frozenset(found)

    def release(self) -> None:
        """Close every held connection."""
        with self._lock:
            abandons, self._abandons = list(self._abandons), collections.deque()
        for abandon in abandons:
            _close_all(abandon)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(abandon) for abandon in self._abandons)


def _inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        try:
            sock.close()
        except OSError:
            continue
