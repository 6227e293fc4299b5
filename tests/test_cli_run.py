"""``peer-elastic run`` behaves like the other subcommands and like torchrun: it finds the job
in the environment, names it, gives each peer torchrun's variables and the log level asked
for, and its exit code is the job's. Real etcd, real launchers, real peers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer_elastic.api import local_rank_from_env
from peer_elastic.cli import ExitCode
from peer_elastic.cli.run import TORCHRUN_VARIABLES, peer_environment, run_outcome
from tests.helpers.procs import PeerProc
from tests.helpers.thread_signal import TGKILL, signal_a_thread_other_than_main

ROOT = Path(__file__).resolve().parents[1]
HELPER = "tests/helpers/launch_env_peer.py"
JOB_LINE = re.compile(r"^peer-elastic: job (\S+) on etcd ([^\s;]+)", re.M)


def launcher(*args: str, env: dict[str, str] | None = None, name: str = "run") -> PeerProc:
    """A command whose output is read while it runs."""
    return PeerProc([sys.executable, "-m", "peer_elastic.cli", *args],
                    {**os.environ, **(env or {})}, name)


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 240) -> subprocess.CompletedProcess:
    """A command run to its end; stdout and stderr together, in order."""
    return subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def env_reports(output: str) -> dict[int, dict]:
    """Each peer's ``ENV`` report, by the peer index of the launcher's prefix."""
    out = {}
    for line in output.splitlines():
        m = re.match(r"^\[peer(\d+)[^\]]*\]: ENV (.*)$", line)
        if m:
            out[int(m[1])] = json.loads(m[2])
    return out


def wait_for_line(p: PeerProc, pattern: str, timeout: float) -> re.Match:
    """The first line of ``p`` matching ``pattern`` (bounded wait on its reader)."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    with p.cond:
        while True:
            for line in p.lines:
                if m := rx.search(line):
                    return m
            left = deadline - time.monotonic()
            if left <= 0 or p.proc.poll() is not None:
                raise AssertionError(f"{p.name}: no line matching {pattern!r}:\n{p.output()}")
            p.cond.wait(min(left, 0.5))


# --- the pieces, without processes ---------------------------------------------------------------


def test_outcome_is_the_jobs() -> None:
    assert run_outcome([0, 0, 0], interrupted=False).code == ExitCode.OK
    # A peer killed by a signal while the others completed: the job survived it.
    killed = run_outcome([0, -signal.SIGKILL, 0], interrupted=False)
    assert killed.code == ExitCode.OK
    assert any("peer 1 was killed by SIGKILL" in n for n in killed.notes)
    assert run_outcome([4, 4, -9], interrupted=False).code == ExitCode.JOB_FAILED
    assert run_outcome([0, 1, 0], interrupted=False).code == ExitCode.FAILED
    assert run_outcome([0, 5], interrupted=False).code == ExitCode.FAILED  # hung: its own code
    assert run_outcome([-9, -15], interrupted=False).code == ExitCode.FAILED  # nobody finished
    # A straggler evicted (exit 7) left gracefully and the job completed without it.
    evicted = run_outcome([0, 7, 0, 0], interrupted=False)
    assert evicted.code == ExitCode.OK
    assert any("peer 1 was evicted as a straggler" in n for n in evicted.notes)
    assert run_outcome([7], interrupted=False).code == ExitCode.FAILED  # nobody finished
    assert run_outcome([0, 0], interrupted=True).code == ExitCode.INTERRUPTED


def test_peer_environment_has_torchruns_launch_values() -> None:
    env = peer_environment({"KEEP": "1"}, 2, 4, 29500)
    assert {k: env[k] for k in TORCHRUN_VARIABLES} == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert env["PEER_ELASTIC_LOCAL_RANK"] == "2" and env["KEEP"] == "1"


@pytest.mark.parametrize("environ, expected", [
    ({}, 0),
    ({"SLURM_LOCALID": "3"}, 3),
    ({"LOCAL_RANK": "2", "SLURM_LOCALID": "3"}, 2),
    ({"PEER_ELASTIC_LOCAL_RANK": "1", "LOCAL_RANK": "2"}, 1),
])
def test_local_rank_comes_from_any_launcher(environ: dict[str, str], expected: int) -> None:
    assert local_rank_from_env(environ) == expected


# --- real launchers ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_gives_each_peer_torchruns_variables_and_the_log_level(etcd: str,
                                                                  unique_job: str) -> None:
    r = cli("run", "--log-level", "debug", "-n", "2", "--start-settle", "0.2", "--",
            sys.executable, HELPER, "--join",
            env={"PEER_ELASTIC_ETCD": etcd, "PEER_ELASTIC_JOB": unique_job}, timeout=500)
    assert r.returncode == ExitCode.OK, r.stdout[-6000:]
    # The job is named at start, and it is the exported one; so is the etcd (no --etcd).
    m = JOB_LINE.search(r.stdout)
    assert m and (m[1], m[2]) == (unique_job, etcd), r.stdout[-6000:]
    reports = env_reports(r.stdout)
    assert sorted(reports) == [0, 1], r.stdout[-6000:]
    master_ports = set()
    for i, rep in reports.items():
        assert rep["PEER_ELASTIC_JOB"] == unique_job and rep["PEER_ELASTIC_ETCD"] == etcd
        assert rep["RANK"] == rep["LOCAL_RANK"] == rep["PEER_ELASTIC_LOCAL_RANK"] == str(i)
        assert rep["WORLD_SIZE"] == rep["LOCAL_WORLD_SIZE"] == "2"
        assert rep["MASTER_ADDR"] == "127.0.0.1"
        master_ports.add(rep["MASTER_PORT"])
        assert rep["local_rank"] == i  # peer.local_rank, through a real join()
        assert rep["PEER_ELASTIC_LOG_LEVEL"] == "DEBUG" and rep["log_level"] == "DEBUG"
    assert len(master_ports) == 1


@pytest.mark.parametrize("flags", [["-v", "run"], ["run", "-v"]], ids=["before", "after"])
def test_verbose_before_or_after_the_subcommand_reaches_the_peers(
        etcd: str, unique_job: str, flags: list[str]) -> None:
    r = cli(*flags, "--etcd", etcd, "--job", unique_job, "-n", "1", "--",
            sys.executable, HELPER)
    assert r.returncode == ExitCode.OK, r.stdout[-6000:]
    assert env_reports(r.stdout)[0]["log_level"] == "INFO", r.stdout[-6000:]


@pytest.mark.timeout(900)
def test_two_launchers_with_the_exported_job_form_one_job(etcd: str, unique_job: str) -> None:
    # One host names the etcd with --etcd, the other only exports it; neither names the job.
    exported = {"PEER_ELASTIC_JOB": unique_job}
    a = launcher("run", "--etcd", etcd, "-n", "1", "--", sys.executable,
                 "tests/helpers/idle_peer.py", env=exported, name="host-a")
    b = launcher("run", "-n", "1", "--", sys.executable, "tests/helpers/idle_peer.py",
                 env={**exported, "PEER_ELASTIC_ETCD": etcd}, name="host-b")
    try:
        for p in (a, b):
            assert wait_for_line(p, JOB_LINE.pattern, 180)[1] == unique_job
            wait_for_line(p, r"\]: READY ", 300)
        status = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "status", "--etcd",
                                 etcd, "--job", unique_job, "--json", "--timeout", "60"],
                                cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["members"]) == 2, status.stdout
        # SIGTERM: the peers leave gracefully; the run was interrupted. The kernel may give
        # it to any thread of the launcher; b's goes to one other than the main thread.
        a.signal(signal.SIGTERM)
        if TGKILL is None:
            b.signal(signal.SIGTERM)
        else:
            signal_a_thread_other_than_main(b.pid, signal.SIGTERM)
        assert [p.wait(timeout=300) for p in (a, b)] == [ExitCode.INTERRUPTED] * 2
    finally:
        a.kill()
        b.kill()


def test_run_without_any_etcd_says_how_to_give_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PEER_ELASTIC_ETCD"}
    r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "run", "-n", "1", "--",
                        "true"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == ExitCode.USAGE
    assert "give --etcd HOST:PORT (or set PEER_ELASTIC_ETCD), or --standalone" in r.stderr


def _peer_pids(launcher_pid: int, script: str) -> list[int]:
    """The launcher's children running ``script`` (its embedded etcd is a child too)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if script.encode() in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_peer_killed_mid_run_does_not_fail_the_run() -> None:
    """``run --standalone -n 3`` of the digits example; one peer SIGKILLed once all three
    train: the job completes without it and the run exits 0. The example's progress lines
    are what shows it training (stdout is a pipe under run)."""
    script = "examples/train_digits.py"
    p = launcher("run", "--standalone", "-n", "3", "--start-settle", "0.5", "--",
                 sys.executable, script, "--epochs", "6", "--progress-every", "1")
    try:
        wait_for_line(p, r"^\[peer\d rank\d\]: epoch \d+ step \d+ rank \d/3 loss \d", 600)
        victims = _peer_pids(p.pid, script)
        assert len(victims) == 3, victims
        os.kill(victims[1], signal.SIGKILL)
        code = p.wait(timeout=800)
        # The launcher's last words; every line before them has been read once they are.
        p.wait_line("peer-elastic: the job completed without them", 60)
    finally:
        p.kill()
    out = p.output()
    assert code == ExitCode.OK, out
    assert re.search(r"test accuracy 0\.\d+ after 6 epochs", out), out
    assert re.search(r"peer-elastic: peer \d was killed by SIGKILL", out), out
