"""Slowing a peer: the whole process (SIGSTOP and SIGCONT in a duty cycle), or only its
compute (:class:`SlowCompute`).

A straggler is a peer that runs, but slowly (a throttled GPU, a noisy neighbour). The tests
and the straggler benchmark make one without any hook in the library: a small process of
its own (not a thread of the harness, whose GIL the harness's own polling holds for
whole milliseconds on a busy machine, stopping the peer for longer than asked) stops the
peer's process for ``stopped_s``, lets it run for ``running_s``, and so on, so it makes
progress at ``running_s / (stopped_s + running_s)`` of its speed (a third with the
defaults). Every thread of the process stops, its coordination thread too, as a whole
machine that is slow would; the stops are short next to the lease TTL and the join
timeout, so the peer stays a healthy member, only a slow one.

Run as a module, it is that process: ``python -m tests.helpers.throttle PID STOPPED_S
RUNNING_S``; it ends (leaving the peer running) on SIGTERM or when the peer is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["DutyCycle", "SlowCompute"]

ROOT = Path(__file__).resolve().parents[2]


class DutyCycle:
    """Stops and continues ``pid`` in turn from a process of its own, until :meth:`stop`."""

    def __init__(self, pid: int, stopped_s: float = 0.2, running_s: float = 0.1) -> None:
        self.pid = pid
        self.stopped_s = stopped_s
        self.running_s = running_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DutyCycle:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.throttle", str(self.pid),
             str(self.stopped_s), str(self.running_s)], cwd=ROOT)
        return self

    def stop(self) -> None:
        """End the cycle and leave the process running."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        _signal(self.pid, signal.SIGCONT)

    def __enter__(self) -> DutyCycle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SlowCompute:
    """While entered, each step of an elastic-worker peer's own work takes ``extra_s``
    longer: a throttled GPU, slow to compute and as fast as ever to communicate. Where the
    duty cycle stops every thread (a whole machine slow, its waits in collectives slowed
    too), this slows only what a peer's score measures. The worker reads ``folder/<pid>``
    at each step (``WORKER_SLOW_DIR``, tests/helpers/elastic_worker.py)."""

    def __init__(self, folder: Path, pid: int, extra_s: float) -> None:
        self.path = folder / str(pid)
        self.extra_s = extra_s

    def __enter__(self) -> SlowCompute:
        part = self.path.with_suffix(".part")
        part.write_text(f"{self.extra_s}")
        part.replace(self.path)  # whole or absent: the worker never reads half of it
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _cycle(pid: int, stopped_s: float, running_s: float) -> None:
    ended = []
    signal.signal(signal.SIGTERM, lambda *_: ended.append(True))
    try:
        while not ended and _signal(pid, signal.SIGSTOP):
            time.sleep(stopped_s)
            _signal(pid, signal.SIGCONT)
            if not ended:
                time.sleep(running_s)
    finally:
        _signal(pid, signal.SIGCONT)


if __name__ == "__main__":
    _cycle(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
