"""Where a test peer runs: a network namespace, and optionally a hostname and /etc/hosts of
its own (a "host" of tests/helpers/hosts.py).

Two ways in, to the same place: :meth:`Place.exec_args` wraps a command for a program of
its own (``ip netns exec`` + ``unshare``, which exec it: same PID), and :meth:`Place.enter`
moves the calling process there, for a peer forked by a server that has imported torch
already (tests/helpers/prefork_server.py), which spares it that import. ``enter`` does what
those commands do, in the same order, with the system calls they make.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

# <sched.h> and <sys/mount.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2
#: Where ``ip netns add`` keeps a namespace's handle.
NETNS_RUN_DIR = "/run/netns"


@dataclass(frozen=True)
class Place:
    """A network namespace (``ip netns`` name); with ``hostname``, a UTS namespace of that
    name and a mount namespace where ``hosts_file`` is ``/etc/hosts``."""

    netns: str
    hostname: str = ""
    hosts_file: str = ""

    def exec_args(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs it here (same PID)."""
        inside = ["ip", "netns", "exec", self.netns]
        if not self.hostname:
            return [*inside, *argv]
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return [*inside, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script, self.hosts_file, self.hostname, *argv]

    def enter(self) -> None:
        """Move this process here. It must have one thread (a fresh fork): a process with
        several cannot take a mount namespace of its own."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(os.path.join(NETNS_RUN_DIR, self.netns), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _call(libc.setns(fd, CLONE_NEWNET), f"setns({self.netns})")
        finally:
            os.close(fd)
        # `ip netns exec`: a mount namespace that sees the namespace's own /sys
        _call(libc.unshare(CLONE_NEWNS | (CLONE_NEWUTS if self.hostname else 0)), "unshare")
        propagation = MS_PRIVATE if self.hostname else MS_SLAVE  # `unshare --propagation`
        _call(libc.mount(b"none", b"/", None, MS_REC | propagation, None), "mount /")
        if libc.umount2(b"/sys", MNT_DETACH) == 0:  # as `ip netns exec`: best effort
            libc.mount(self.netns.encode(), b"/sys", b"sysfs", 0, None)
        if self.hostname:
            _call(libc.mount(self.hosts_file.encode(), b"/etc/hosts", None, MS_BIND, None),
                  "mount --bind /etc/hosts")
            name = self.hostname.encode()
            _call(libc.sethostname(name, len(name)), "sethostname")


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
