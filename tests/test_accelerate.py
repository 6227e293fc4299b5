"""``accelerate launch --rdzv_backend peer-elastic`` on a real etcd: two launchers on one host
stand for two machines; their workers (an ``Accelerator`` each, gloo on CPU) form one group
through the peer-elastic rendezvous and exit 0. Also what accelerate itself refuses or
replaces, with what the user sees.

``accelerate launch --multi_gpu`` hands its arguments to torchrun's ``run()``: the options it
has no flag for (``--rdzv-id``, a ``--nnodes`` range) come from torchrun's ``PET_*``
variables, and the etcd endpoints from ``--main_process_ip/--main_process_port`` (with
``--num_machines`` > 1) or ``PEER_ELASTIC_ETCD``. See docs/accelerate.md.

Needs accelerate and the package installed (``pip install -e .[test]``): torchrun finds the
backend through the ``torchrun.handlers`` entry point. Each launcher imports torch and
accelerate (several seconds on a loaded 2-core machine); every wait is bounded.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.torchrun import BACKEND, run_prefix

pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "helpers" / "accelerate_worker.py"
LAUNCHER_TIMEOUT_S = 240.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not any(ep.name == BACKEND
                for ep in importlib.metadata.entry_points(group="torchrun.handlers")),
        reason="the torchrun.handlers entry point is not installed (pip install -e .)"),
]


def _env(tmp_path: Path, out: Path, **extra: str) -> dict[str, str]:
    """The launcher's environment: nothing inherited that would steer the launch (a user's
    accelerate config, torchrun's ``PET_*``, an etcd of the shell), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "PEER_ELASTIC_ETCD", "ACCELERATE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), ACCEL_TEST_DIR=str(out), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def _launch(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``accelerate launch ARGS worker`` (``python -m accelerate.commands.launch`` is the
    same command as the ``accelerate launch`` script)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args, str(WORKER)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    """The launchers' exit codes, each waited for at most ``LAUNCHER_TIMEOUT_S``; on a
    timeout every launcher and its workers are killed and the logs shown."""
    try:
        return [p.wait(LAUNCHER_TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        _kill(procs)
        raise AssertionError(f"a launcher did not finish in {LAUNCHER_TIMEOUT_S:.0f} s\n"
                             f"{_tails(logs)}") from None


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun's workers are in sessions of their own
            p.wait(10)


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def _reports(out: Path) -> list[dict]:
    """What each worker wrote (``rank<N>``), by process index."""
    files = sorted(out.glob("rank*"), key=lambda p: int(p.name[4:]))
    return [json.loads(p.read_text()) for p in files]


def _job_keys(etcd: str, job: str) -> dict[str, bytes]:
    """The job's rendezvous keys (not its store), relative to its prefix."""
    prefix = run_prefix(job)
    with EtcdClient(etcd) as client:
        kvs, _ = client.get_prefix(prefix)
    return {kv.key[len(prefix):]: kv.value for kv in kvs
            if not kv.key[len(prefix):].startswith("store/")}


def _assert_one_group(out: Path, etcd: str, job: str, procs: list[subprocess.Popen],
                      world: int, logs: list[Path]) -> None:
    """Every worker saw the same group of ``world`` processes, made of both launchers'
    workers, and etcd holds the peer-elastic round of the two launchers' agents."""
    reports = _reports(out)
    assert len(reports) == world, _tails(logs)
    for r in reports:
        assert r["num_processes"] == world
        assert r["gathered"] == list(range(world))
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["backend"] == "gloo"
        assert r["run_id"] == job
    assert {r["agent_pid"] for r in reports} == {p.pid for p in procs}, \
        "each launcher is an agent of this group"
    assert {r["group_rank"] for r in reports} == {0, 1}
    keys = _job_keys(etcd, job)
    record = json.loads(keys["round"])
    assert len(record["members"]) == 2
    # Agent ids are host-pid-random: the round's members are the two launchers.
    assert {int(m.split("-")[-2]) for m in record["members"]} == {p.pid for p in procs}
    assert "closed" in keys, "the finished job closed its rendezvous"


def _two_launchers_form_one_group(args: list[str], env: dict[str, str], tmp_path: Path,
                                  out: Path, etcd: str, job: str, world: int) -> None:
    """Start two launchers with ``args``; both exit 0 and their workers formed one group of
    ``world`` through the peer-elastic backend."""
    logs = [tmp_path / f"launcher{i}.log" for i in range(2)]
    procs: list[subprocess.Popen] = []
    try:
        procs = [_launch(args, env, log) for log in logs]
        assert _finish(procs, logs) == [0, 0], _tails(logs)
        _assert_one_group(out, etcd, job, procs, world, logs)
    finally:
        _kill(procs)


def test_launchers_with_a_node_range_form_one_group(etcd: str, unique_job: str,
                                                    tmp_path: Path) -> None:
    """The elastic form: each machine runs ``accelerate launch --multi_gpu --num_processes 2
    --main_process_port 0 --rdzv_backend peer-elastic`` with ``PEER_ELASTIC_ETCD`` (the etcd
    endpoints, a list is fine), ``PET_RDZV_ID`` and ``PET_NNODES=2:3`` (a range: accelerate's
    ``--num_machines`` only takes one number). ``--num_processes`` is per machine here,
    since accelerate sees one machine. Two launchers: one group of 2 x 2 workers."""
    out = tmp_path / "out"
    out.mkdir()
    env = _env(tmp_path, out, PEER_ELASTIC_ETCD=etcd, PET_RDZV_ID=unique_job,
               PET_NNODES="2:3")
    args = ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
            "--rdzv_backend", BACKEND, "--rdzv_conf", "last_call_timeout=2",
            "--max_restarts", "3", "--monitor_interval", "0.5",
            "--mixed_precision", "no", "--dynamo_backend", "no"]
    _two_launchers_form_one_group(args, env, tmp_path, out, etcd, unique_job, 4)


def test_launchers_with_num_machines_reach_etcd_through_main_process_ip(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    """accelerate's multi-machine form: ``--num_machines 2 --main_process_ip ETCD_HOST
    --main_process_port ETCD_PORT`` becomes torchrun's ``--rdzv-endpoint`` (one endpoint).
    ``--machine_rank 1`` on both launchers: peer-elastic ignores machine ranks (ranks follow
    agent age), and accelerate tests the port on this host only for machine rank 0, where
    etcd is using it (see the next test). 2 processes on 2 machines: one worker each."""
    out = tmp_path / "out"
    out.mkdir()
    host, port = etcd.split(",")[0].rsplit(":", 1)
    env = _env(tmp_path, out, PET_RDZV_ID=unique_job)
    args = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2",
            "--machine_rank", "1", "--main_process_ip", host, "--main_process_port", port,
            "--rdzv_backend", BACKEND, "--rdzv_conf", "last_call_timeout=2",
            "--max_restarts", "3", "--monitor_interval", "0.5",
            "--mixed_precision", "no", "--dynamo_backend", "no"]
    _two_launchers_form_one_group(args, env, tmp_path, out, etcd, unique_job, 2)


def test_machine_rank_0_on_the_etcd_host_is_refused(etcd: str, unique_job: str,
                                                    tmp_path: Path) -> None:
    """With ``--num_machines`` > 1, accelerate checks on machine rank 0 that nothing on
    ``localhost`` uses ``--main_process_port``; there etcd does, so it refuses before any
    agent starts: exit 1 and a ConnectionError, and no agent reached etcd."""
    out = tmp_path / "out"
    out.mkdir()
    host, port = etcd.split(",")[0].rsplit(":", 1)
    env = _env(tmp_path, out, PET_RDZV_ID=unique_job)
    args = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2",
            "--machine_rank", "0", "--main_process_ip", host, "--main_process_port", port,
            "--rdzv_backend", BACKEND, "--mixed_precision", "no", "--dynamo_backend", "no"]
    log = tmp_path / "launcher.log"
    procs: list[subprocess.Popen] = []
    try:
        procs = [_launch(args, env, log)]
        assert _finish(procs, [log]) == [1], _tails([log])
        text = log.read_text()
        assert (f"ConnectionError: Tried to launch distributed communication on port `{port}`,"
                " but another process is utilizing it.") in text, text[-3000:]
        assert _job_keys(etcd, unique_job) == {}
    finally:
        _kill(procs)


def test_a_busy_port_with_one_machine_switches_to_torch_standalone(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    """With ``--num_machines 1`` (the elastic form) and a ``--main_process_port`` in use on
    this host (here etcd's), accelerate does not refuse: it warns and launches torchrun
    ``--standalone``, which replaces the rendezvous backend by a local c10d one. The job
    runs alone, never through etcd: hence ``--main_process_port 0`` in the elastic form."""
    out = tmp_path / "out"
    out.mkdir()
    port = etcd.split(",")[0].rsplit(":", 1)[1]
    env = _env(tmp_path, out, PEER_ELASTIC_ETCD=etcd, PET_RDZV_ID=unique_job)
    args = ["--multi_gpu", "--num_processes", "2", "--main_process_port", port,
            "--rdzv_backend", BACKEND, "--mixed_precision", "no", "--dynamo_backend", "no"]
    log = tmp_path / "launcher.log"
    procs: list[subprocess.Popen] = []
    try:
        procs = [_launch(args, env, log)]
        assert _finish(procs, [log]) == [0], _tails([log])
        text = log.read_text()
        assert f"Port `{port}` is already in use." in text, text[-3000:]
        reports = _reports(out)
        assert [r["num_processes"] for r in reports] == [2, 2]
        assert all(r["run_id"] != unique_job for r in reports), "a random standalone id"
        assert _job_keys(etcd, unique_job) == {}, "the peer-elastic backend was not used"
    finally:
        _kill(procs)
