"""Start a test peer as a fork of a server that has imported torch (tests/helpers/
prefork_server.py), behind the part of :class:`subprocess.Popen`'s interface the harness uses.

:func:`start` returns a :class:`ForkedProcess`, or None where the peer must be its own
program: ``$PEER_ELASTIC_TEST_PREFORK=0``, or a command that is not ``python -m <module>``
of this interpreter, or of a startup environment beyond the first :data:`MAX_GROUPS`. One
group of servers per environment a process reads at its start (everything but the
variables peers read later: :data:`READ_LATER`), each server kept while its pytest process
runs; the peers of a group take its servers in turn, so two peers started
one after the other never share the string-hash seed a server drew at its start.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from tests.helpers.place import Place

ROOT = Path(__file__).resolve().parents[2]
SERVER = "tests.helpers.prefork_server"
#: ``0``: every peer is its own program, as without this module.
ENABLE_ENV = "PEER_ELASTIC_TEST_PREFORK"
#: Variables only read after a peer started (its settings, the worker's knobs, pytest's
#: note of the current test): they may differ between the peers of one server.
READ_LATER = ("PEER_ELASTIC_", "WORKER_", "GROUP_PROC_", "PYTEST_CURRENT_TEST",
              "GLOO_SOCKET_IFNAME")
#: Servers per startup environment, taken in turn.
SERVERS_PER_GROUP = 2
#: Startup environments with servers of their own; peers of any other are their own
#: programs (a server pays for itself over several peers, not over one or two).
MAX_GROUPS = 3
START_TIMEOUT_S = 120.0


def start(argv: list[str], env: Mapping[str, str], cwd: Path = ROOT,
          place: Place | None = None) -> ForkedProcess | None:
    """``argv`` (``[sys.executable, "-m", module, *args]``) started as a fork of one of this
    process's servers, in ``place`` (a network namespace, a host) where one is given, or
    None where it must be started as a program of its own (see the module doc)."""
    return _pool.start(argv, env, cwd, place)


def startup_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a process reads as it starts (its servers' key)."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(READ_LATER)))


class ForkedProcess:
    """A peer forked by a server: ``pid``, ``stdout`` (text), ``poll``, ``wait``,
    ``returncode``, ``send_signal``, ``terminate`` and ``kill`` as :class:`subprocess.Popen`
    has them. Its exit status comes from the server, which reaps it."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout_fd: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = open(stdout_fd, encoding=None, errors=None)  # as Popen(text=True)
        self._conn = conn
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> int | None:
        """The exit code, once the server sent it (waiting up to ``timeout``); reading it
        lets the server reap the peer. Several threads may ask at once."""
        if self.returncode is not None:
            return self.returncode
        try:
            ready, _, _ = select.select([self._conn], [], [], timeout)
        except (ValueError, OSError):  # another thread read it and closed the socket
            ready = []
        with self._lock:
            if self.returncode is not None or not ready:
                return self.returncode
            msg = self._conn.recv(64)
            if not msg:
                self._conn.close()
                raise RuntimeError(f"the prefork server of pid {self.pid} ended before it")
            self.returncode = int(msg)
            with contextlib.suppress(OSError):
                self._conn.send(b"read")
            self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """One prefork server process and the socket it listens on."""

    def __init__(self, env: Mapping[str, str]) -> None:
        # stdin: the server ends once it closes (when this process ends) and its peers did.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", SERVER], cwd=ROOT, env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.path = ""
        self._ready = threading.Event()
        self._failure = ""
        threading.Thread(target=self._await_ready, daemon=True).start()

    def _await_ready(self) -> None:
        """Wait for ``READY <socket path>`` (it imports torch first)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        word, _, path = line.decode(errors="replace").strip().partition(" ")
        if word == "READY" and path:
            self.path = path
        else:
            self._failure = line.decode(errors="replace") + self.proc.stdout.read().decode(
                errors="replace")
        self._ready.set()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def wait_ready(self) -> None:
        if not self._ready.wait(START_TIMEOUT_S) or self._failure:
            raise RuntimeError(f"the prefork server did not start: {self._failure}")

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: Path,
              place: Place | None = None) -> ForkedProcess:
        self.wait_ready()
        import json

        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = json.dumps({"module": module, "args": args, "env": env,
                                  "cwd": str(cwd),
                                  "place": None if place is None else asdict(place)}).encode()
            socket.send_fds(conn, [request], [write_fd])
            pid = int(conn.recv(64))
        except BaseException:
            os.close(read_fd)
            conn.close()
            raise
        finally:
            os.close(write_fd)
        return ForkedProcess([sys.executable, "-m", module, *args], pid, conn, read_fd)


class Pool:
    """Servers by startup environment: ``servers_per_group`` for each of the first
    ``max_groups`` environments asked for."""

    def __init__(self, servers_per_group: int = SERVERS_PER_GROUP,
                 max_groups: int = MAX_GROUPS) -> None:
        self.servers_per_group = servers_per_group
        self.max_groups = max_groups
        self._lock = threading.Lock()
        self._groups: dict[tuple[tuple[str, str], ...], list[Server]] = {}
        self._turn = 0

    def start(self, argv: list[str], env: Mapping[str, str], cwd: Path = ROOT,
              place: Place | None = None) -> ForkedProcess | None:
        if os.environ.get(ENABLE_ENV, "1") == "0":
            return None
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return None
        server = self._server_for(env)
        return (None if server is None
                else server.spawn(argv[2], argv[3:], dict(env), cwd, place))

    def _server_for(self, env: Mapping[str, str]) -> Server | None:
        """The next server of ``env``'s group (started on first use); None when there are
        ``max_groups`` groups already and ``env`` is of none of them."""
        key = startup_env(env)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                if len(self._groups) >= self.max_groups:
                    return None
                group = self._groups[key] = [Server(dict(key))
                                             for _ in range(self.servers_per_group)]
                for server in group:  # so that a server slower to start delays none of
                    server.wait_ready()  # the peers started together
            self._turn += 1
            return group[self._turn % len(group)]

    def close(self) -> None:
        """Start no more peers; each server ends once its peers have (closes its stdin)."""
        with self._lock:
            servers = [s for group in self._groups.values() for s in group]
            self._groups.clear()
        for server in servers:
            server.close()


_pool = Pool()
