"""The ``peer-elastic`` command, run as a user would, for tests that drive a job through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from peer_elastic.etcd_server import free_port


def cli(etcd: str, *args: str) -> str:
    """``peer-elastic ARGS --etcd ETCD``'s output; fails the test unless it exits 0."""
    out = subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args, "--etcd", etcd],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def start_etcd_command(data_dir: Path) -> tuple[subprocess.Popen, int]:
    """``peer-elastic etcd --data-dir DATA_DIR`` on a free port, once it printed that it is
    healthy: the process (its stderr a text pipe) and the port. The caller stops it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "peer_elastic.cli", "etcd", "--data-dir",
                             str(data_dir), "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[2],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert f"127.0.0.1:{port}" in proc.stderr.readline()  # printed once it is healthy
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc, port
