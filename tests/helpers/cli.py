"""The ``peer-elastic`` command, run as a user would, for tests that drive a job through it."""

from __future__ import annotations

import subprocess
import sys


def cli(etcd: str, *args: str) -> str:
    """``peer-elastic ARGS --etcd ETCD``'s output; fails the test unless it exits 0."""
    out = subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args, "--etcd", etcd],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
