"""Destroyed process groups, kept alive for a while so that no user object frees one.

Why: on torch 2.13 a process would freeze whole (no logs, no lease keep-alives, every
thread stopped) when the last reference to a destroyed gloo group was dropped by a C++
object freed with the GIL held. That object is a DDP wrapper's reducer when a reset
callback rebuilds DDP (the README's recipe) and the old wrapper goes. ``~ProcessGroupGloo``
waits for its worker threads. A worker still finishing a collective that was issued inside
``backward()`` (DDP's buckets, gradient hooks) then frees the work, and with it the
thread-local state captured at issue, which holds a Python object: the context that
torch's backward stashes for its threads. Freeing that needs the GIL, which the thread
waiting for the worker holds. py-spy of a frozen peer (SIGSTOP/SIGCONT soak under load,
about one run in three with DDP) showed exactly that: the main thread in
``Reducer::~Reducer`` → ``~ProcessGroupGloo`` → ``thread::join``, and a gloo thread in
``~AsyncAllreduceWork`` → ``gil_scoped_acquire``.

torch's binding of ``ProcessGroup`` itself releases the GIL in its destructor. So the
group manager :meth:`retires <RetiredGroups.retire>` every group it destroys: it keeps one
reference until the next group is destroyed, a generation later (by then the reset
callbacks have replaced the DDP wrappers of the old group, and its collectives have ended:
its connections were shut down when it was destroyed). Then it drops that reference on a
helper thread, so the destructor runs with the GIL released and may wait for the worker
threads without holding up the training thread.

A destructor still running on a helper must end before the interpreter finalizes. When
it ends later, its return into Python (``~gil_scoped_release`` taking the GIL back) meets
a finalizing interpreter, which ends the thread with ``pthread_exit``; the forced unwind
through that destructor calls ``std::terminate`` and the process dies with SIGABRT
("terminate called without an active exception") after its work was done (CI: a peer
that printed its result, then exited -6). So :meth:`RetiredGroups.release` waits for every
helper still running, not only its own, and an ``atexit`` hook waits (bounded) for any
helper left, since ``atexit`` runs before the interpreter starts finalizing.

One job: hold and drop group references. It neither creates nor destroys a group.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

from peer_elastic.process import threads

__all__ = ["RetiredGroups"]

log = logging.getLogger(__name__)

#: How long the interpreter's exit waits for destructors still running on helpers: a
#: destroyed gloo group's workers end their collectives within the collective timeout
#: (its connections are shut down), so this bounds a normal exit, not a stuck one.
EXIT_WAIT_S = 60.0

_HELPER_NAME = "peer-elastic-retired-groups"
_running: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # helpers of every instance


@atexit.register
def _wait_at_exit() -> None:
    helpers = [h for h in list(_running) if h.is_alive()]
    if helpers and threads.join_all(helpers, EXIT_WAIT_S):
        log.error("destroyed process groups still finishing their collectives after %.0f s "
                  "at exit; the process may abort (SIGABRT) when they end", EXIT_WAIT_S)


class RetiredGroups:
    """The groups destroyed lately; see the module docstring."""

    def __init__(self) -> None:
        self._kept: list[Any] = []
        self._helpers: list[threading.Thread] = []  # dropping older groups; may still run
        self._lock = threading.Lock()

    def retire(self, *groups: Any) -> None:
        """Keep ``groups`` (``torch.distributed.ProcessGroup`` objects, before they are
        destroyed: the default group and every subgroup made in it, which a user's DDP
        wrapper may hold as well) until the next call; drop the ones kept before them, off
        this thread. ``None`` entries are ignored."""
        kept = [g for g in groups if g is not None]
        if not kept:
            return
        with self._lock:
            older, self._kept = self._kept, kept
        if older:
            self._drop(older)

    def release(self, wait_s: float) -> bool:
        """Drop every kept group now (the peer is done with groups); wait at most
        ``wait_s`` for their destructors, and for those of groups dropped earlier that
        are still running. False when some were still running then."""
        with self._lock:
            kept, self._kept = self._kept, []
        if kept:
            self._drop(kept)
        with self._lock:
            helpers, self._helpers = self._helpers, []
        if not threads.join_all(helpers, wait_s):
            return True
        log.warning("destroyed process groups still finishing their collectives after "
                    "%.1f s; not waiting for them", wait_s)
        with self._lock:
            self._helpers.extend(h for h in helpers if h.is_alive())
        return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def _drop(self, groups: list[Any]) -> None:
        box = list(groups)
        groups.clear()  # the caller's list lets go: box holds the last references

        def drop() -> None:
            box.clear()  # the ProcessGroup destructors run here, the GIL released

        # Not through process.threads: join()'s cleanup waits for its threads a bounded while,
        # then warns that the process may abort. A destructor may run longer (up to the
        # collective timeout), and the atexit hook above waits for it longer still; so the
        # helpers are tracked here, by that hook and release(), and nowhere else.
        helper = threading.Thread(target=drop, name=_HELPER_NAME, daemon=True)
        _running.add(helper)
        helper.start()
        with self._lock:
            self._helpers = [h for h in self._helpers if h.is_alive()] + [helper]
