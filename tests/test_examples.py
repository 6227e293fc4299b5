"""The README and the examples do what they say, on a real etcd with real peers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic.config import JOB_FIELDS
from peer_elastic.etcd_server import free_port
from tests.helpers.cli import start_etcd_command

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def run(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_configuration_table_matches_the_code() -> None:
    for f in JOB_FIELDS:
        row = re.search(rf"^\| `{f.name}` \| `{f.env}` \| ([^|]+) \|", CONFIGURATION, re.M)
        assert row, f"docs/configuration.md lacks a row for {f.name}"
        if f.kind is str:  # snapshot_dir: empty by default, which the table spells out
            assert row.group(1).strip() == (f"`{f.default}`" if f.default else "(empty: off)")
            continue
        assert float(row.group(1)) == float(f.default), f"documented default of {f.name}"


def test_readme_api_example_runs_on_two_peers(etcd: str, unique_job: str, tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert 'etcd="127.0.0.1:2379"' in code and 'job="demo"' in code
    code = code.replace('etcd="127.0.0.1:2379"', f'etcd="{etcd}"').replace(
        'job="demo"', f'job="{unique_job}"')
    script = tmp_path / "readme_example.py"
    script.write_text(code + "\nprint('OK', peer.rank, peer.size, flush=True)\n")
    env = {**os.environ, "PEER_ELASTIC_START_SETTLE": "0.5"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o.strip().splitlines()[-1] for o in outs) == ["OK 0 2", "OK 1 2"]


@pytest.mark.slow
@pytest.mark.parametrize("averaging", [[], ["--ddp"]], ids=["DistributedOptimizer", "ddp"])
def test_digits_example_trains_to_its_target(averaging: list[str]) -> None:
    r = run([sys.executable, "-m", "peer_elastic.cli", "run", "--standalone", "-n", "2",
             "--start-settle", "0.5", "--", sys.executable, "examples/train_digits.py",
             "--epochs", "4", "--target", "0.85", *averaging])
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"test accuracy 0\.\d+ after 4 epochs", r.stdout), r.stdout


def test_status_json_schema_on_a_running_job(etcd: str, unique_job: str) -> None:
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator

    client = EtcdClient(etcd)
    c = Coordinator(client, unique_job, JobSettings(start_settle_s=0.1),
                    labels={"rack": "r7", "zone": "b"}).start()
    try:
        c.wait_generation(0, timeout=10)
        r = run([sys.executable, "-m", "peer_elastic.cli", "status", "--etcd", etcd, "--job",
                 unique_job, "--json"], timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        for key in ("job", "generation", "world_size", "leader", "members", "progress", "done"):
            assert key in doc
        assert doc["generation"] == 1 and doc["world_size"] == 1 and doc["leader"] == c.member_id
        assert doc["members"][0]["id"] == c.member_id and doc["members"][0]["rank"] == 0
        assert {"id", "host", "rank"} <= set(doc["members"][0])
        assert doc["members"][0]["labels"] == {"rack": "r7", "zone": "b"}  # join(labels=...)
    finally:
        c.close()
        client.close()


@pytest.mark.parametrize("args, code, text", [
    (["status", "--etcd", "127.0.0.1:{port}", "--job", "x", "--timeout", "1.5"], 3,
     "no etcd endpoint answered"),
    (["status", "--etcd", "nonsense:port", "--job", "x"], 2, "bad etcd endpoint"),
    (["status", "--etcd", "{etcd}", "--job", "no-such-job-here"], 6, "has no running run"),
    (["status", "--etcd", "{etcd}", "--job", "../x"], 2, "invalid job name"),
    (["run", "--standalone", "--etcd", "x:1", "-n", "1", "--", "true"], 2, "not allowed with"),
    (["run", "--standalone", "-n", "1"], 2, "give the command"),
])
def test_cli_bad_input_gives_one_clear_line(args, code, text, etcd: str) -> None:
    args = [a.format(port=free_port(), etcd=etcd) for a in args]
    r = run([sys.executable, "-m", "peer_elastic.cli", *args], timeout=60)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert text in r.stderr and "Traceback" not in r.stderr


def test_etcd_command_serves_until_interrupted(tmp_path: Path) -> None:
    import signal
    import time
    import urllib.request

    proc, port = start_etcd_command(tmp_path / "data")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert b'"health":"true"' in r.read()
        for _ in range(50):  # Ctrl-C pressed again and again must not deadlock it
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        time.sleep(0.2)
        assert (tmp_path / "data").exists()  # the data dir is the user's: kept
    finally:
        proc.kill()
        proc.wait(timeout=10)
