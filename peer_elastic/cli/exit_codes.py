"""What the ``peer-elastic`` command's exit status means: one enum, the table in docs/cli.md.

Every expected failure ends as one line on stderr that names the fix, and one of these
codes (:class:`CommandFailed` carries both from where the failure is found to the place
that prints it); a traceback means a bug.
"""

from __future__ import annotations

import enum

__all__ = ["CommandFailed", "ExitCode"]


class ExitCode(enum.IntEnum):
    """The exit codes of ``peer-elastic``. 5 is left out on purpose: it is a peer's own code
    for a hung training thread (``peer_elastic.EXIT_HUNG``), never the command's."""

    #: the command did what it was asked; for ``run``: the job completed
    OK = 0
    #: the command failed (a file it cannot write, a port it cannot serve on, an etcd it
    #: cannot start); for ``run``: a peer failed on its own, or no peer finished
    FAILED = 1
    #: bad usage or settings (a flag, a value, a job setting no job can run with)
    USAGE = 2
    #: no etcd endpoint answered within ``--timeout``
    ETCD_UNREACHABLE = 3
    #: the job failed as a whole (reset limit, elastic timeout, sharded state lost)
    JOB_FAILED = 4
    #: the job has no running run in etcd (unknown, misspelt, or ended over run_ttl_s ago)
    NO_SUCH_JOB = 6
    #: stopped by Ctrl-C (SIGINT); for ``run``: SIGINT or SIGTERM, its peers left gracefully
    INTERRUPTED = 130


class CommandFailed(Exception):
    """An expected failure of a command: the one line to print and the exit code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
