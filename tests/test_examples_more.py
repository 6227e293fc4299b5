"""The Horovod port and the chaos demo run end to end (short runs, real etcd, real peers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bounded(args: list[str], timeout: float) -> tuple[int, str]:
    """Run ``args``; on timeout send SIGTERM first (both commands then kill their peers and
    stop their etcd), SIGKILL only if that does not end it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_horovod_port_trains_on_two_peers() -> None:
    rc, out = run_bounded(
        [sys.executable, "-m", "peer_elastic.cli", "run", "--standalone", "-n", "2",
         "--start-settle", "0.5", "--", sys.executable, "examples/horovod_port.py",
         "--epochs", "2"],
        timeout=120)
    assert rc == 0, out[-6000:]
    m = re.search(r"Test set: Average loss: \d+\.\d+, Accuracy: (\d+\.\d+)%", out)
    assert m, out[-6000:]
    assert 10.0 < float(m.group(1)) <= 100.0, m.group(0)  # better than chance
    assert out.count("Accuracy:") == 1, "only rank 0 prints the test result"


@pytest.mark.slow
def test_chaos_demo_quick_survives_a_crash() -> None:
    # Two disruptions (seed 7: a SIGKILL, then a new peer) over 20 epochs: the example's
    # whole path, in the least time.
    rc, out = run_bounded([sys.executable, "examples/chaos_demo.py", "--quick", "--seed", "7",
                           "--actions", "2", "--epochs", "20"], timeout=180)
    assert rc == 0, out[-6000:]
    assert "chaos seed 7" in out
    assert "ACTION SIGKILL" in out, out[-6000:]
    assert re.search(r"RESET -> generation \d+", out), out[-6000:]
    m = re.search(r"resets: (\d+)", out)
    assert m and int(m.group(1)) >= 1, out[-6000:]
    assert re.search(r"final: test accuracy 0\.\d+ after 20 epochs", out), out[-6000:]
    assert "result: the job finished successfully" in out
