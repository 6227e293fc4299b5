"""The threads peer-elastic starts, so that a peer's exit can wait until they have ended.

Why: CPython up to 3.13 ends a daemon thread that still runs when the interpreter finalizes
with ``pthread_exit``, the next time that thread takes the GIL (python/cpython gh-87135,
changed only in 3.14). A thread inside gRPC's or torch's C++ at that moment unwinds through
C++ frames: the process aborts (``terminate called without an active exception``,
pytorch#38228), or a lock the thread held stays held and the exiting main thread waits for
it forever. CI saw peers print their result and then never exit, and a process exit after
``join()`` found up to three of these threads still running (a probe listener blocked in
``accept``, gRPC's request consumer of a stream, etcd3's watch thread).

So every thread of a peer is started here (daemon, as before: a crash must never wait for
them), each owner still stops its own, and :func:`join`'s cleanup ends with
:func:`wait_all_ended`: bounded, and it names the threads that outlived it.

One job: start and track threads. It stops nothing itself.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["join_all", "running", "start", "wait_all_ended"]

_started: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_lock = threading.Lock()


def start(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread called ``name``, tracked until it ends."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:
        _started.add(thread)
    thread.start()
    return thread


def running() -> list[threading.Thread]:
    """The threads started here that have not ended (the caller's own left out)."""
    me = threading.current_thread()
    with _lock:
        return [t for t in list(_started) if t.is_alive() and t is not me]


def join_all(pending: Iterable[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Join ``pending`` within ``timeout_s`` in all; those still running then."""
    pending = list(pending)
    deadline = time.monotonic() + timeout_s
    for thread in pending:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in pending if t.is_alive()]


def wait_all_ended(timeout_s: float) -> list[str]:
    """Wait at most ``timeout_s`` in all until every thread started here has ended (their
    owners were asked to stop them); the names of those still running then."""
    join_all(running(), timeout_s)
    return [t.name for t in running()]
