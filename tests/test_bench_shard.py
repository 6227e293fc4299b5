"""The sharded-state benchmark at a tiny size: it runs end to end (a commit's save, a DCP
checkpoint, a crash 3 -> 2, ``regroup``, a DCP load) and every resharded state matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_bench_shard_tiny(tmp_path: Path) -> None:
    out = tmp_path / "shard.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_shard.py"), "--params", "0.005",
         "--rounds", "1", "--reps", "1", "--dir", str(tmp_path), "--timeout", "120",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    crash, memory = report["crash"], report["memory"][0]
    assert crash["checksums_match"] and crash["dcp_checksums_match"]
    assert crash["moved_bytes"] > 0 and crash["new_copy_bytes"] > 0
    assert crash["regroup"]["median"] > 0 and crash["dcp_load"]["median"] > 0
    assert report["commit"]["save"]["median"] > 0
    assert memory["shard_bytes_w2"] > memory["shard_bytes_w3"] > 0
    assert not list(tmp_path.glob("bench_shard_dcp_*")), "the DCP checkpoint was left behind"
