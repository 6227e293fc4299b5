"""A signal sent to one thread of another process other than its main one.

Why: the kernel gives a process-directed signal to any thread that does not block it, and
Python runs the handler in the main thread only, at its next bytecode. A command whose main
thread sleeps in one endless wait then never handles it; sending the signal to another
thread on purpose (``tgkill(2)``) makes that case happen every time instead of now and then.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: tgkill(2)'s system call number where it is known (None elsewhere: skip the test).
TGKILL: int | None = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def signal_a_thread_other_than_main(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the lowest-numbered thread of ``pid`` that is not its main thread."""
    assert TGKILL is not None
    libc = ctypes.CDLL(None, use_errno=True)
    tid = min(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert libc.syscall(TGKILL, pid, tid, int(sig)) == 0, os.strerror(ctypes.get_errno())
