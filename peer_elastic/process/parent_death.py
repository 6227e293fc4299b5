"""Child processes that end with the process that started them (Linux).

``peer-elastic run`` starts the peers, and with ``--standalone`` an etcd, and stops them
when it is interrupted. When the launcher itself is SIGKILLed (``kill -9``, the OOM killer,
a CI job's timeout), none of its code runs: the etcd would serve on forever, holding its
ports and temp dir, and the peers would train on with nobody reading their output. The
kernel covers that case: a parent-death signal (``prctl(PR_SET_PDEATHSIG)``), set in the
child between fork and exec, is sent to the child when its parent dies.

Two caveats, each handled where it applies:

* The "parent" is the *thread* that forked the child: a child started from a thread that
  ends first gets the signal then. So this is for processes started from a command-line
  tool's main thread, whose end is the process's end.
* The parent may die between the fork and the ``prctl``: the child then checks that its
  parent is still the process that forked it, and signals itself if not.

The function the child runs is resolved in the parent and only calls ``prctl``,
``getppid`` and ``kill``: a ``preexec_fn`` must not take locks (other threads may have held
them at the fork) or import anything. A ``preexec_fn`` also makes the child a real
``fork()``, which runs gRPC's fork handlers when they are on: ``peer_elastic.etcd`` turns
them off, since with them a child died of SIGABRT before it ran 1-2 % of the time.

Elsewhere than on Linux (or without a usable libc) there is no such signal and
:func:`die_with_parent` returns None: the child outlives a killed parent, as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child receive ``sig``
    when the thread that starts it ends (the main thread: when this process ends, by SIGKILL
    included); None where the platform has no such signal.

    Call it in the process that starts the child (it records that process), and start the
    child from the thread whose end should end it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    signum = int(sig)
    getppid, kill, getpid = os.getppid, os.kill, os.getpid

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if getppid() != parent:  # the parent died before the prctl: too late to be told
            kill(getpid(), signum)

    return in_child
