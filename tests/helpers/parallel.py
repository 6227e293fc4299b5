"""The suite run over several pytest-xdist workers: how many, and the tests that run alone.

Most tests share the machine, one per core: each keeps about a core busy with its peers
(the suite is bound by CPU, measured). A test marked ``alone`` runs with no other test at the
same time (it loads the CPU on purpose, or measures how long something takes); the workers
coordinate through :class:`RunLock`, a readers-writer lock on files every worker of one run
shares.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Workers for ``-n auto`` (pyproject's addopts): the suite's tests are written for a loaded
#: 2-core machine, and each starts several peers of its own; more workers than this load
#: the machine beyond what their timeouts allow for, whatever the number of cores.
MAX_WORKERS = 2


def auto_workers(cpus: int | None = None) -> int:
    """Workers for ``-n auto``: one per core, at most :data:`MAX_WORKERS`."""
    return max(1, min(cpus if cpus is not None else (os.cpu_count() or 1), MAX_WORKERS))


class RunLock:
    """Shared by the tests of one run, exclusive for a test that runs alone.

    Two files in ``where`` (a directory every worker of the run sees): ``room`` is held
    shared by each running test and exclusively by one that runs alone; ``gate`` is held
    while taking ``room``, so a test waiting to run alone keeps new tests from slipping in
    ahead of it (it would wait for ever on a worker that starts one test after another).
    ``flock`` locks belong to the open file, and the kernel drops them when a worker dies.
    """

    def __init__(self, where: Path) -> None:
        self.gate = where / "gate.lock"
        self.room = where / "room.lock"

    @contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        with open(self.gate, "a") as gate, open(self.room, "a") as room:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(room, fcntl.LOCK_UN)
