"""What keeps the dashboard's small HTTP server safe to leave running.

* :class:`HostAllowList`: a request's ``Host`` header must name this server. A web page
  anywhere can make a browser send requests to a name that its DNS points at 127.0.0.1
  (DNS rebinding); the browser then treats the answers as that page's own. Such a request
  still carries the page's host name, which is not on the list, so it is refused.
* :class:`ReadDeadlines`: a connection must deliver a whole request head within a deadline;
  one that does not (idle, or a byte at a time: "slowloris") is shut down by one thread.
* :class:`ConnectionCap`: at most so many connections are served at once; one more is answered
  ``503`` at once, by the accepting thread, and closed, so neither threads nor sockets grow
  without bound and the server keeps accepting.

Nothing here knows about jobs or etcd.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable

from peer_elastic.process import threads

__all__ = ["LOOPBACK_NAMES", "ConnectionCap", "HostAllowList", "ReadDeadlines", "host_of"]

#: Names every allow-list holds: they resolve to this machine whatever DNS says.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_of(header: str) -> str:
    """The host name or address in a ``Host`` header value, without port or brackets,
    lower case: ``[::1]:8080`` is ``::1``, ``Example.org.`` is ``example.org``."""
    value = header.strip().lower()
    if value.startswith("["):  # an IPv6 literal, perhaps with a port
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostAllowList:
    """The ``Host`` values a server answers: loopback names, any IP address, the address it
    binds (unless a wildcard), and names given (``--allow-host``).

    An address in ``Host`` cannot come from DNS rebinding (that needs a name the page's
    author controls), so every address is allowed; names must be listed.
    """

    def __init__(self, bind_host: str, names: Iterable[str] = ()) -> None:
        allowed = set(LOOPBACK_NAMES) | {host_of(n) for n in names if n.strip()}
        if host_of(bind_host) not in _WILDCARDS:
            allowed.add(host_of(bind_host))
        self.names = frozenset(allowed)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header (None: none) may be answered."""
        if not header:
            return False  # HTTP/1.1 requires it, and every browser sends it
        host = host_of(header)
        return host in self.names or host.endswith(".localhost") or _is_address(host)


class ReadDeadlines:
    """Shuts down a connection that has not delivered its request head by its deadline.

    A handler :meth:`arm`\\ s its socket before it reads a request and :meth:`disarm`\\ s it
    once the head is read. One thread waits for the nearest deadline; shutting the socket
    down ends the handler's blocked read, and with it the connection.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadlines: dict[socket.socket, float] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self.expired = 0  # connections shut down for being too slow (for tests and logs)
        self._thread: threading.Thread | None = None

    def start(self) -> ReadDeadlines:
        self._thread = threads.start(self._run, "dashboard-deadlines")
        return self

    def arm(self, sock: socket.socket) -> None:
        with self._cond:
            self._deadlines[sock] = time.monotonic() + self.timeout_s
            self._cond.notify()

    def disarm(self, sock: socket.socket) -> None:
        with self._cond:
            self._deadlines.pop(sock, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                late = [s for s, d in self._deadlines.items() if d <= now]
                for sock in late:
                    del self._deadlines[sock]
                    self.expired += 1
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already closed by its handler
                        pass
                nearest = min(self._deadlines.values(), default=None)
                self._cond.wait(None if nearest is None else max(0.0, nearest - now))


class ConnectionCap:
    """At most ``limit`` connections served at once (:meth:`try_enter` / :meth:`leave`)."""

    #: What a connection past the cap is told before it is closed.
    _BUSY_BODY = b"too many connections; try again shortly\n"
    BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
            % (len(_BUSY_BODY), _BUSY_BODY))

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a connection cap must be at least 1, got {limit}")
        self.limit = limit
        self._active = 0
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def active(self) -> int:
        return self._active

    def try_enter(self) -> bool:
        with self._lock:
            if self._active >= self.limit:
                self.refused += 1
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._active -= 1

    def refuse(self, sock: socket.socket) -> None:
        """Tell ``sock`` the server is busy and close it, without ever blocking long: a
        fresh connection's send buffer takes the few bytes at once."""
        try:
            sock.settimeout(0.5)
            sock.sendall(self.BUSY)
            sock.shutdown(socket.SHUT_WR)  # the answer first, then the end of it
        except OSError:
            pass
        finally:
            sock.close()
