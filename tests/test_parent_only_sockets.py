"""ParentOnlySockets on real sockets and a real fork: once the parent closes a socket it
registered, the socket is closed for good, though a child forked before still lives (a
DataLoader worker of a SIGKILLed peer). Sockets nobody registered stay the child's."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from peer_elastic.process.parent_only_sockets import ParentOnlySockets

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")


@contextmanager
def forked_child(report: Callable[[], bytes]) -> Iterator[bytes]:
    """A child forked now that sends ``report()`` (run in the child) and lives until the
    block ends; yields what it sent."""
    to_parent_r, to_parent_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(to_parent_r)
            os.close(release_w)
            os.write(to_parent_w, report() + b"\n")
            os.read(release_r, 1)  # lives on until the parent's block ends
        finally:
            os._exit(0)
    os.close(to_parent_w)
    os.close(release_r)
    try:
        with os.fdopen(to_parent_r, "rb") as f:
            yield f.readline().rstrip(b"\n")
    finally:
        os.close(release_w)  # the child reads end-of-file and exits
        os.waitpid(pid, 0)


def fd_target(fd: int) -> bytes:
    return os.readlink(f"/proc/self/fd/{fd}").encode()


def test_a_registered_listener_refuses_once_the_parent_closes_it_though_a_child_lives(
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    kept = ParentOnlySockets()
    kept.set(inodes=[os.fstat(listener.fileno()).st_ino])
    try:
        with forked_child(lambda: fd_target(listener.fileno())) as seen:
            assert seen == b"/dev/null", "the child still holds the listener"
            listener.close()  # as the kernel does when the peer dies
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        kept.release()
        listener.close()


def test_a_connection_to_a_registered_address_ends_when_the_parent_closes_it() -> None:
    # gloo's connections are known by their listeners' addresses: both the connection made
    # to a listener and the one it accepted have that address at one end.
    listener = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))  # not registered
    kept = ParentOnlySockets()
    kept.set(addresses=[listener.getsockname()])
    client = socket.create_connection(listener.getsockname(), timeout=10)
    accepted, _ = listener.accept()
    unrelated = socket.create_connection(other.getsockname(), timeout=10)
    unrelated_peer, _ = other.accept()
    try:
        fds = (client.fileno(), accepted.fileno(), unrelated.fileno())
        with forked_child(lambda: b" ".join(fd_target(fd) for fd in fds)) as seen:
            c, a, u = seen.split(b" ")
            assert c == a == b"/dev/null"
            assert u.startswith(b"socket:["), "a socket nobody registered is the child's"
            client.close()
            accepted.settimeout(30)
            assert accepted.recv(1) == b"", "the closed end is still open in the child"
            unrelated.close()
            unrelated_peer.settimeout(1)
            with pytest.raises(TimeoutError):  # the child still holds this one
                unrelated_peer.recv(1)
        # and the parent's own sockets were never touched
        assert fd_target(accepted.fileno()).startswith(b"socket:[")
    finally:
        kept.release()
        for s in (listener, other, client, accepted, unrelated, unrelated_peer):
            s.close()


def test_released_sockets_are_left_to_the_child() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    kept = ParentOnlySockets()
    kept.set(inodes=[os.fstat(listener.fileno()).st_ino], addresses=[listener.getsockname()])
    kept.release()
    try:
        with forked_child(lambda: fd_target(listener.fileno())) as seen:
            assert seen.startswith(b"socket:[")
    finally:
        listener.close()
