"""The listener every peer keeps on its group address: it accepts and closes.

Two uses: the others check that they reach this peer before a group forms
(:func:`peer_elastic.process.netaddr.probe`), and a connection it *refuses* proves this peer's
process is gone (:mod:`peer_elastic.etcd.deaths`). For the second, no forked child may keep
it open after the peer dies (:mod:`peer_elastic.process.parent_only_sockets`).
"""

from __future__ import annotations

import os
import socket

from peer_elastic.process import threads
from peer_elastic.process.parent_only_sockets import ParentOnlySockets

__all__ = ["ProbeListener"]


class ProbeListener:
    """A TCP listener on the group address that accepts and closes (reachability probes)."""

    def __init__(self, address: str) -> None:
        fam = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(fam, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))
        # A stopped process still "answers" while its kernel queues connections: keep room
        # for every peer's probes of a long stop (each prober: 1-2 per round).
        self._sock.listen(1024)
        self.address = address
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._parent_only = ParentOnlySockets()
        self._parent_only.set(inodes=[os.fstat(self._sock.fileno()).st_ino])
        self._thread = threads.start(self._serve, "peer-elastic-probe")

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening; wait (bounded) for the thread, which must not outlive the peer
        (peer_elastic.process.threads)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self._sock.close()
        self._parent_only.release()
        self._thread.join(wait_s)
