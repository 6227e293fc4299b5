"""How a serving command (``etcd``, ``dashboard``) is stopped, and what its exit code says.

SIGTERM is the ordinary way a service manager, a container runtime or a script stops a
server: the server did its job, exit 0. Ctrl-C (SIGINT) is a person interrupting it: 130,
as a shell expects.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType

from peer_elastic.cli.exit_codes import ExitCode
from peer_elastic.process.signal_relay import SignalRelay

__all__ = ["StopSignals"]


class StopSignals:
    """While entered, SIGINT and SIGTERM only set an event (off the handler, through
    :class:`~peer_elastic.process.signal_relay.SignalRelay`: a repeated Ctrl-C must not deadlock the
    server's orderly stop); the first of them decides :attr:`exit_code`."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._first: int | None = None
        self._lock = threading.Lock()
        self._relay = SignalRelay((signal.SIGINT, signal.SIGTERM), self._on_signal)

    def _on_signal(self, signum: int) -> None:
        with self._lock:
            if self._first is None:
                self._first = signum
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop signal came (within ``timeout``, None: no limit)."""
        return self._stopped.wait(timeout)

    @property
    def exit_code(self) -> ExitCode:
        """OK unless stopped by Ctrl-C (INTERRUPTED); OK too when no signal came."""
        return ExitCode.INTERRUPTED if self._first == signal.SIGINT else ExitCode.OK

    def __enter__(self) -> StopSignals:
        self._relay.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._relay.uninstall()
