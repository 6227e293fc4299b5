"""Slowing a process from outside: SIGSTOP and SIGCONT in a duty cycle.

A straggler is a peer that runs, but slowly (a throttled GPU, a noisy neighbour). The tests
and the straggler benchmark make one without any hook in the library: a thread of the
harness stops the peer's process for ``stopped_s``, lets it run for ``running_s``, and so
on, so it makes progress at ``running_s / (stopped_s + running_s)`` of its speed (a third
with the defaults). Every thread of the process stops, its coordination thread too, as a
whole machine that is slow would; the stops are short next to the lease TTL and the join
timeout, so the peer stays a healthy member, only a slow one.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["DutyCycle"]


class DutyCycle:
    """Stops and continues ``pid`` in turn from a thread, until :meth:`stop`."""

    def __init__(self, pid: int, stopped_s: float = 0.2, running_s: float = 0.1) -> None:
        self.pid = pid
        self.stopped_s = stopped_s
        self.running_s = running_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DutyCycle:
        self._thread = threading.Thread(target=self._cycle, name=f"duty-cycle:{self.pid}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the cycle and leave the process running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._signal(signal.SIGCONT)

    def __enter__(self) -> DutyCycle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _cycle(self) -> None:
        while not self._stop.is_set():
            if not self._signal(signal.SIGSTOP):
                return
            stopped = self._stop.wait(self.stopped_s)
            self._signal(signal.SIGCONT)
            if stopped or self._stop.wait(self.running_s):
                return

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True
