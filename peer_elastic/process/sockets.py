"""This process's sockets, found by their inodes in ``/proc/self/fd`` (Linux).

Sockets that other code owns (gloo's, gRPC's) are known to us only this way: by the inode
that names a socket for as long as it is open, and the descriptor that holds it now.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection

from peer_elastic.process.netaddr import plain_ip

__all__ = ["Address", "keep_from_exec", "open_socket", "socket_inodes", "tcp_ends"]

Address = tuple[str, int]  # (plain ip, port)

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, int]:
    """``{socket inode: fd}`` of this process (empty where ``/proc`` is missing)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def open_socket(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it still is socket ``inode`` (fds are reused), else None.
    Closing the returned object closes only the duplicate."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)  # owns dup; family and type read from the kernel
    except OSError:
        os.close(dup)
        return None


def tcp_ends(fd: int, inode: int) -> tuple[Address | None, Address | None]:
    """(local, remote) of ``fd`` if it still is TCP socket ``inode``, each as (plain ip,
    port); None for an end it has not (a listener's remote) and for anything but TCP.
    (Plain: an IPv4 end of a dual-stack socket, ``::ffff:a.b.c.d``, as ``a.b.c.d``.)"""
    sock = open_socket(fd, inode)
    if sock is None:
        return None, None
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or sock.type != socket.SOCK_STREAM:
            return None, None
        ends: list[Address | None] = []
        for name in (sock.getsockname, sock.getpeername):
            try:
                end = name()
                ends.append((plain_ip(end[0]), end[1]))
            except OSError:  # not connected, or closed meanwhile
                ends.append(None)
    return ends[0], ends[1]


def keep_from_exec(inodes: Collection[int]) -> int:
    """Mark this process's descriptors of sockets ``inodes`` close-on-exec; how many.

    gloo opens its sockets without it, so a program run from a peer by ``os.system`` or
    ``posix_spawn`` (no Python in between to close them) would hold the peer's gloo
    connections open for as long as it runs, a dead peer's included."""
    count = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            if os.fstat(fd).st_ino == inode:  # not closed and reused meanwhile
                os.set_inheritable(fd, False)
                count += 1
        except OSError:  # closed meanwhile
            pass
    return count
