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

One job: hold and drop group references. It neither creates nor destroys a group.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["RetiredGroups"]

log = logging.getLogger(__name__)


class RetiredGroups:
    """The groups destroyed lately; see the module docstring."""

    def __init__(self) -> None:
        self._kept: list[Any] = []
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
            self._drop(older, wait_s=0.0)

    def release(self, wait_s: float) -> bool:
        """Drop every kept group now (the peer is done with groups); wait at most
        ``wait_s`` for their destructors. False when they were still running then."""
        with self._lock:
            kept, self._kept = self._kept, []
        return self._drop(kept, wait_s) if kept else True

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    @staticmethod
    def _drop(groups: list[Any], wait_s: float) -> bool:
        box = list(groups)
        groups.clear()  # the caller's list lets go: box holds the last references

        def drop() -> None:
            box.clear()  # the ProcessGroup destructors run here, the GIL released

        helper = threading.Thread(target=drop, name="peer-elastic-retired-groups",
                                  daemon=True)
        helper.start()
        if wait_s > 0:
            helper.join(wait_s)
            if helper.is_alive():
                log.warning("destroyed process groups still finishing their collectives "
                            "after %.0f s; not waiting for them", wait_s)
                return False
        return True
