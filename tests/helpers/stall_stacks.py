"""Every thread's stack, written once a test worker's training loop has stalled.

A Python thread that holds the GIL while it dumps. faulthandler's own timer
(``dump_traceback_later``) reads the other threads' frames from a C thread without the GIL,
while they run: a soak peer died of SIGSEGV in the middle of such a dump (seed 295988996,
stop 30). With the GIL held, no other thread changes its Python frames during the dump.
The price: a stall inside a native call that holds the GIL shows no stacks here (``SIGUSR1``,
at_exit.install, still answers then).
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time


class StallStacks:
    """``beat()`` at each batch; once ``after_s`` pass without one, every thread's stack goes
    to stderr, once per stall (nothing before the first beat). ``close()`` ends its thread
    (before the process exits)."""

    def __init__(self, after_s: float) -> None:
        self._after_s = after_s
        self._last: float | None = None  # armed by the first beat
        self._dumped = False
        self._dumps = threading.Semaphore(0)  # one release per dump (tests wait on it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="test-stall-stacks",
                                        daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()
        self._dumped = False

    def wait_dumped(self, timeout: float) -> bool:
        """Whether a dump happened (since the last one waited for) within ``timeout``."""
        return self._dumps.acquire(timeout=timeout)

    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(1.0, self._after_s / 4)
        while not self._stop.wait(poll):
            last = self._last
            if last is None or self._dumped:
                continue
            stalled = time.monotonic() - last
            if stalled >= self._after_s:
                self._dumped = True
                sys.stderr.write(f"test worker: no batch began for {stalled:.1f} s; "
                                 "stacks of all threads:\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(all_threads=True)
                self._dumps.release()
