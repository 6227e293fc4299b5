"""Sockets a forked child must not keep: a child of a peer can outlive it.

``fork()`` copies every descriptor, and a connection or a listener stays open as long as
any process holds it. torch's ``DataLoader`` forks its workers from the training process,
mid-run, and a worker whose parent was SIGKILLed lives on for up to 5 s (it looks at its
parent's pid between waits of ``MP_STATUS_CHECK_INTERVAL``), or as long as its dataset
blocks. While it lives it holds the dead peer's gloo connections open, so the others'
collective gets no reset, and its probe listener, so a probe connects (the kernel accepts
into the backlog) and nothing proves the death (:mod:`peer_elastic.etcd.deaths`). Measured:
a crashed peer with two DataLoader workers was replaced after 4.3 s instead of 0.12 s.

So owners say which sockets are theirs: :meth:`ParentOnlySockets.set` with inodes, and
with addresses (a socket whose local or remote end is one of them: a gloo listener and every
connection made to it or accepted by it). In every child forked from Python (``os.fork``,
``multiprocessing``, a ``preexec_fn``), a hook puts ``/dev/null`` over each such descriptor:
the child no longer holds the socket, and the number stays taken, so code in the child that
closes it later closes ``/dev/null`` and not a number reused meanwhile. The parent's
sockets are untouched. Nothing else of the child's changes: a connection your dataset opened
before the fork is not ours and stays.

The hook runs in the child, where a lock another thread held at the fork stays held for
good: it takes none. The parent publishes one immutable picture, replaced whole under a
lock, and the child reads that reference.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable

from peer_elastic.process.netaddr import plain_ip
from peer_elastic.process.sockets import Address, socket_inodes, tcp_ends

__all__ = ["ParentOnlySockets"]

_lock = threading.Lock()
_keys = itertools.count()
_owned: dict[int, tuple[frozenset[int], frozenset[Address]]] = {}  # under _lock
# Every owner's inodes and addresses together: replaced whole, read by the child unlocked.
_picture: tuple[frozenset[int], frozenset[Address]] = (frozenset(), frozenset())


class ParentOnlySockets:
    """The sockets one owner keeps from forked children (see the module); :meth:`release`
    when they are closed."""

    def __init__(self) -> None:
        self._key = next(_keys)

    def set(self, *, inodes: Iterable[int] | None = None,
            addresses: Iterable[Address] | None = None) -> None:
        """Replace this owner's inodes, its addresses, or both (None: keep as they are)."""
        with _lock:
            old_inodes, old_addresses = _owned.get(self._key, (frozenset(), frozenset()))
            _owned[self._key] = (
                old_inodes if inodes is None else frozenset(inodes),
                old_addresses if addresses is None else
                frozenset((plain_ip(host), port) for host, port in addresses))
            _publish()

    def release(self) -> None:
        with _lock:
            _owned.pop(self._key, None)
            _publish()


def _publish() -> None:
    global _picture
    _picture = (frozenset().union(*(i for i, _ in _owned.values())),
                frozenset().union(*(a for _, a in _owned.values())))


def _in_child() -> None:
    inodes, addresses = _picture
    if not inodes and not addresses:
        return
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        for inode, fd in socket_inodes().items():
            if inode not in inodes and not (addresses and addresses.intersection(
                    tcp_ends(fd, inode))):
                continue
            try:
                os.dup2(devnull, fd, inheritable=False)
            except OSError:
                pass
    finally:
        os.close(devnull)


os.register_at_fork(after_in_child=_in_child)
