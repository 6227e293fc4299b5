"""deploy/slurm/peer-elastic.sbatch: syntax, the variables it sets, and a dry run under fake
``srun``/``scancel`` (no Slurm here: the script's own logic, its etcd on the batch host and
the per-task environment are real; Slurm's scheduling is not)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic import settings_table
from peer_elastic.etcd_server import find_etcd_binary, free_port

SBATCH = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "peer-elastic.sbatch"

FAKE_SRUN = """#!/bin/bash
# One task: drop srun's options, give the task a node name and a local id, run it.
while [[ "$1" == --* ]]; do shift; done
# The script starts its tasks at once: take the first free slot with an atomic mkdir (a
# read-then-write counter file gave two tasks the same node under load).
n=0; until mkdir "$FAKE_DIR/slot$n" 2>/dev/null; do n=$((n + 1)); done
export SLURMD_NODENAME=node$n SLURM_LOCALID=0
exec "$@"
"""
FAKE_SCANCEL = """#!/bin/bash
echo "$@" >> "$FAKE_DIR/scancel"
"""
# No steps but the script's own: nobody joined with `srun --jobid`.
FAKE_SQUEUE = """#!/bin/bash
echo "$SLURM_JOB_ID.batch"
"""
TASK = """
import json, os, sys
from peer_elastic.etcd.client import client_from_env
with client_from_env() as c:  # the etcd the script gave us answers
    c.put("/slurm-test/" + os.environ["PEER_ELASTIC_HOST"], b"1")
keys = [k for k in os.environ if k.startswith("PEER_ELASTIC_")]
out = {k: os.environ[k] for k in keys}
out["argv"] = sys.argv[1:]
with open(os.path.join(os.environ["FAKE_DIR"], os.environ["PEER_ELASTIC_HOST"] + ".json"), "w") as f:
    json.dump(out, f)
"""


def test_script_syntax() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_script_sets_only_variables_a_peer_reads() -> None:
    text = SBATCH.read_text()
    set_here = set(re.findall(r"(?:export |\b)(PEER_ELASTIC_[A-Z_]+)=", text))
    assert set_here >= {"PEER_ELASTIC_JOB", "PEER_ELASTIC_ETCD", "PEER_ELASTIC_HOST",
                        "PEER_ELASTIC_LOCAL_RANK"}
    for name in set_here | set(re.findall(r"\$\{?(PEER_ELASTIC_[A-Z_]+)", text)):
        settings_table.by_env(name)  # KeyError: a variable peer-elastic does not read


@pytest.mark.timeout(120)
def test_dry_run_starts_etcd_and_one_peer_per_task(tmp_path: Path) -> None:
    try:
        etcd_bin = find_etcd_binary()
    except FileNotFoundError:
        pytest.skip("no etcd binary")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    task = tmp_path / "task.py"
    task.write_text(TASK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEER_ELASTIC_")}
    env.update(PATH=f"{fake}:{Path(sys.executable).parent}:{env['PATH']}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID="4242", SLURM_NTASKS="3", TMPDIR=str(tmp_path),
               TRAIN_PYTHON=sys.executable, ETCD_PORT=str(free_port()),
               PEER_ELASTIC_ETCD_BINARY=etcd_bin,
               PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(["bash", str(SBATCH), str(task), "--epochs", "2"], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(tmp_path.glob("node*.json"))
    assert [p.stem for p in seen] == ["node0", "node1", "node2"]
    for p in seen:
        doc = json.loads(p.read_text())
        assert doc["PEER_ELASTIC_JOB"] == "slurm-4242"
        assert doc["PEER_ELASTIC_HOST"] == p.stem
        assert doc["PEER_ELASTIC_LOCAL_RANK"] == "0"
        assert doc["argv"] == ["--epochs", "2"]
    assert shutil.which("srun", path=str(fake))
