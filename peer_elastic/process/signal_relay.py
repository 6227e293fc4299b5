"""Signals handled on a thread of their own: the signal handler itself takes no lock.

Why: a Python signal handler runs in the main thread between two bytecodes, wherever that
thread is, inside a lock it holds included, and inside the same handler still running for
the signal before. A peer's SIGTERM handler used to set an ``Event`` and start a thread:
both take locks (the event's condition, the thread bookkeeping). A second SIGTERM that
came while the first run held such a lock ran the handler again, nested, and that run
waited forever for the lock its own outer run held. Measured: of 5 peers sent 200
SIGTERMs within about 0.2 s, one stayed stuck for good, its main thread in nested
``Event.set``; CI saw a peer of a SIGKILLed ``peer-elastic run`` never exit, its main
thread blocked in five nested handler runs. Repeats are ordinary: an operator presses
Ctrl-C twice, a supervisor repeats its SIGTERM, and an orphan's parent-death signal can come
again after it was reparented (``prctl(2)``: when a subreaper it went to ends).

So :class:`SignalRelay`'s handler only writes the signal's number to a pipe (``os.write``:
no Python lock; when the pipe is full a byte is already waiting, and one is enough), and a
thread of its own reads the pipe and calls the action, once per signal number per read.

One job: move a signal from its handler to a thread. What the signal means is the
caller's action.

A child forked while a relay is installed (a ``multiprocessing`` helper forked from the
training process, the default start method on Linux) gets the handlers from before the
relay back, and lets go of the pipe. Else its handler would write into the parent's pipe: a
SIGTERM sent to the helper alone (its ``terminate()``) made the *peer* leave the job, and
the helper lived on; and the parent's relay would not read end-of-file while the child held
the pipe's write end. (DataLoader workers set a SIGTERM handler of their own.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any

from peer_elastic.process import threads

__all__ = ["SignalRelay"]

log = logging.getLogger(__name__)

# The relays installed now. Added to and removed from by the main thread; read in a forked
# child (atomic operations under the GIL: the child sees the set whole).
_installed: set[SignalRelay] = set()


class SignalRelay:
    """While installed, each of ``signals`` calls ``action(signum)`` on the relay's thread.

    Install from the main thread (Python's rule for signal handlers); :meth:`uninstall`
    puts the previous handlers back and lets the thread end after the action in progress.
    A signal that came while installed is ignored from then on instead: the process is on
    its way out because of it, and a repeat of the same burst must not kill it midway (a
    peer left within 0.15 s of the first of 200 SIGTERMs and died of a later one, exit
    -15 instead of 0). Also a context manager.
    """

    def __init__(self, signals: Iterable[signal.Signals], action: Callable[[int], Any],
                 name: str = "peer-elastic-signals") -> None:
        self._signals = tuple(signals)
        self._action = action
        self._name = name
        self._previous: dict[signal.Signals, Any] = {}
        self._received: set[int] = set()  # added to by the handler (atomic under the GIL)
        self._write_fd = -1
        self._read_fd = -1
        self._pipe_inode = -1  # both ends': a child closes only fds that still are the pipe
        self.thread: threading.Thread | None = None

    def install(self) -> SignalRelay:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # a handler never blocks, whatever arrives
        self._write_fd, self._read_fd = write_fd, read_fd
        self._pipe_inode = os.fstat(read_fd).st_ino
        self.thread = threads.start(self._relay, self._name, args=(read_fd,))
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _installed.add(self)
        return self

    def uninstall(self) -> None:
        _installed.discard(self)
        for sig, previous in self._previous.items():
            if sig in self._received:
                previous = signal.SIG_IGN
            elif previous is None:  # not set from Python: the default is closest
                previous = signal.SIG_DFL
            signal.signal(sig, previous)
        self._previous.clear()
        if self._write_fd >= 0:
            os.close(self._write_fd)  # the relay reads end-of-file and ends
            self._write_fd = -1

    def _forget_in_child(self) -> None:
        """In a forked child: the handlers from before the relay, and no pipe (why: the
        module docstring). The relay's thread exists only in the parent."""
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
            except (ValueError, OSError):  # pragma: no cover - forked from a subinterpreter
                pass
        self._previous.clear()
        for fd in (self._write_fd, self._read_fd):
            try:
                if os.fstat(fd).st_ino == self._pipe_inode:
                    os.close(fd)
            except OSError:
                pass
        self._write_fd = self._read_fd = -1

    def __enter__(self) -> SignalRelay:
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs anywhere in the main thread, maybe nested in itself: no locks, no logging.
        self._received.add(signum)
        try:
            os.write(self._write_fd, bytes((signum,)))
        except OSError:  # full (a byte is waiting already) or uninstalled meanwhile
            pass

    def _relay(self, read_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 64):
                for signum in dict.fromkeys(chunk):  # a burst of one signal acts once
                    try:
                        self._action(signum)
                    except Exception:
                        log.exception("handling signal %d failed", signum)
        finally:
            os.close(read_fd)


def _in_child() -> None:
    for relay in tuple(_installed):
        relay._forget_in_child()
    _installed.clear()


os.register_at_fork(after_in_child=_in_child)
