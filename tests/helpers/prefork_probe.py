"""A peer that describes its process (tests/test_prefork.py): one ``PROBE <json>`` line, then
it exits as its arguments say (``exit <code>``, ``raise``, ``wait`` until its stdin or a
signal ends it, ``linger``: prints ``AT-EXIT`` from an atexit handler)."""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
from pathlib import Path

import numpy


def describe() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "pgid": os.getpgid(0),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "fds": sorted(int(fd) for fd in os.listdir(f"/proc/{os.getpid()}/fd")),
        "stdin": os.readlink("/proc/self/fd/0"),
        "stdout_is_stderr": os.path.samestat(os.fstat(1), os.fstat(2)),
        "grpc": "grpc" in sys.modules,
        "threads": threading.active_count(),
        "str_hash": hash("peer-elastic"),
        "numpy_draw": int(numpy.random.randint(1 << 30)),
        # where it runs (tests/helpers/place.py)
        "netns": os.readlink("/proc/self/ns/net"),
        "uts": os.readlink("/proc/self/ns/uts"),
        "hostname": socket.gethostname(),
        "etc_hosts": Path("/etc/hosts").read_text(),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "sys_class_net": sorted(os.listdir("/sys/class/net")),
    }


def main() -> int:
    print("PROBE", json.dumps(describe()), flush=True)
    what = sys.argv[1:] or ["exit", "0"]
    if what[0] == "exit":
        return int(what[1])
    if what[0] == "raise":
        raise RuntimeError("the probe raised")
    if what[0] == "linger":
        atexit.register(lambda: print("AT-EXIT", flush=True))
        return 0
    threading.Event().wait()  # "wait": until a signal ends it
    return 0


if __name__ == "__main__":
    sys.exit(main())
