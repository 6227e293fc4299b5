"""Temp dirs that name the processes using them, and the sweep of those left by dead ones.

``EtcdServer`` keeps an embedded etcd's data and log in a temp dir and removes it on
``stop()``. A launcher that is SIGKILLed never gets there: its etcd ends with it (a
parent-death signal), but the dir stays behind, with the 64 MB of write-ahead log etcd
preallocates. Nobody is left to remove it, so the next server does: each owned dir lists
its owners (the launcher and its etcd), and every new owned dir first removes the dirs of
the same prefix whose owners have all exited.

A process is named by its pid *and* its start time (``/proc/<pid>/stat``), so a reused pid
does not keep a dir alive, nor does the sweep ever take the dir of a running process. Only
on Linux; elsewhere nothing is swept. A dir without a readable owners file (being created
right now, or not made here) is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OWNERS = "owners"  # one "<pid> <start time>" line per owner


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from a later one with the same pid by its start time."""

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The process with ``pid`` now, or None if there is none (or no /proc). A zombie
        has exited: nobody may have reaped it yet (an orphan's new parent may never)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X"):  # field 3, the state: zombie, dead
            return None
        return cls(pid, int(fields[19]))

    def alive(self) -> bool:
        return ProcessId.of(self.pid) == self


def make_owned_dir(prefix: str, sweep_prefix: str | None = None) -> Path:
    """A new temp dir ``prefix*`` owned by this process, made after sweeping the dirs
    ``sweep_prefix*`` (default: ``prefix``) whose owners have all exited."""
    sweep(sweep_prefix if sweep_prefix is not None else prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    add_owner(path, os.getpid())
    return path


def add_owner(path: Path, pid: int) -> None:
    """Name one more process that keeps ``path`` in use (best effort)."""
    me = ProcessId.of(pid)
    if me is None:
        return
    try:
        with open(path / OWNERS, "a") as f:
            f.write(f"{me.pid} {me.start}\n")
    except OSError as exc:
        log.debug("cannot record owner %d of %s: %s", pid, path, exc)


def owners(path: Path) -> list[ProcessId] | None:
    """The processes ``path`` names, or None if it names none or cannot be read."""
    try:
        lines = (path / OWNERS).read_text().split("\n")
        found = [ProcessId(int(pid), int(start))
                 for pid, start in (line.split() for line in lines if line.strip())]
    except (OSError, ValueError):
        return None
    return found or None


def sweep(prefix: str, where: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the dirs in ``where`` (the temp dir) named ``prefix*`` whose owners have all
    exited; returns them. Best effort: what cannot be read or removed is left."""
    if not Path("/proc/self/stat").exists():
        return []
    base = Path(where if where is not None else tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    except OSError:
        return []
    for path in candidates:
        named = owners(path)
        if named is None or any(p.alive() for p in named):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            log.info("removed %s: left behind by processes that have exited", path)
            removed.append(path)
    return removed
