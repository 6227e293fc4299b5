"""A SIGKILLed launcher takes its children with it (peer_elastic.process.parent_death), on real
processes: the peers ``peer-elastic run`` started, and its embedded etcd."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from peer_elastic.etcd_server import WORK_DIR_PREFIX
from peer_elastic.process.owned_dirs import sweep
from peer_elastic.process.parent_death import die_with_parent
from tests.helpers.procs import gone, native_stacks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

ROOT = Path(__file__).resolve().parent.parent
GONE_TIMEOUT_S = 60.0  # generous: etcd shuts down gracefully on a loaded machine


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still running after GONE_TIMEOUT_S. A process that is not our child cannot
    be waited on, but its pidfd becomes readable when it exits: wait on those."""
    fds = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # already gone (and reaped)
                fds.append(os.pidfd_open(pid))
        deadline = time.monotonic() + GONE_TIMEOUT_S
        waiting = list(fds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            exited, _, _ = select.select(waiting, [], [], left)
            waiting = [fd for fd in waiting if fd not in exited]
    finally:
        for fd in fds:
            os.close(fd)
    return [p for p in pids if not gone(p)]


def _kill_leftovers(pids: list[int]) -> None:
    """A failed test leaves nothing running (these processes are not our children)."""
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _etcd_serving(url: str) -> tuple[int, Path]:
    """The pid of the etcd process serving ``url`` (found by its command line), and the temp
    dir its launcher made for it (nobody is left to remove it but a later sweep)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "etcd" in cmdline[0] and any(url in arg for arg in cmdline):
            data = next(a.split("=", 1)[1] for a in cmdline if a.startswith("--data-dir="))
            return int(entry.name), Path(data).parent
    raise AssertionError(f"no process serves {url}")


def test_a_child_gets_the_signal_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, subprocess, sys, time\n"
         "from peer_elastic.process.parent_death import die_with_parent\n"
         "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent(signal.SIGTERM))\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(300)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        children.append(int(parent.stdout.readline()))
        assert not gone(children[0])
        parent.kill()
        parent.wait(timeout=30)
        assert _wait_gone(children) == [], "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(timeout=30)
        _kill_leftovers(children)


def test_it_is_a_preexec_function_on_linux() -> None:
    assert callable(die_with_parent(signal.SIGTERM))


def _launcher_children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_for_world(etcd: str, job: str, size: int) -> None:
    """Until the job trains with ``size`` members (asked the way an operator would)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "status", "--etcd", etcd,
                            "--job", job, "--json", "--timeout", "5"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and json.loads(r.stdout)["world_size"] == size:
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} never trained with {size} members")


def _kill_launcher_and_wait(launcher: subprocess.Popen[str], children: list[int]) -> None:
    launcher.kill()
    launcher.wait(timeout=30)
    left = _wait_gone(children)
    # Their output went to the dead launcher's pipes: where they are is all there is to show.
    assert left == [], ("children outlived the SIGKILLed launcher:"
                        + "".join(native_stacks(pid) for pid in left))


TRAIN = [sys.executable, "examples/train_digits.py", "--epochs", "1000"]  # trains on and on


SPAWN_BESIDE_BUSY_GRPC = """
import collections, signal, subprocess, sys, threading
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.process.parent_death import die_with_parent

client = EtcdClient(sys.argv[1])
stop = threading.Event()

def busy(n):  # gRPC's poller and its threads at work while the children start
    i = 0
    while not stop.is_set():
        client.put(f"{sys.argv[2]}/{n}/{i % 8}", b"x")
        i += 1

workers = [threading.Thread(target=busy, args=(n,)) for n in range(2)]
for w in workers:
    w.start()
in_child = die_with_parent(signal.SIGTERM)
codes = collections.Counter()
for _ in range(int(sys.argv[3])):
    child = subprocess.Popen(["true"], preexec_fn=in_child, stderr=subprocess.PIPE)
    _, err = child.communicate()
    codes[child.returncode] += 1
    if child.returncode:
        print(child.returncode, err.decode(errors="replace")[-300:], flush=True)
stop.set()
for w in workers:
    w.join()
client.close()
print("codes", dict(codes), flush=True)
"""


@pytest.mark.slow
def test_children_started_with_a_preexec_fn_beside_busy_grpc_all_start(
        etcd: str, unique_job: str) -> None:
    """``peer-elastic run`` starts its peers with a ``preexec_fn`` (the parent-death signal)
    while its rank tracker's etcd client may be at work. With gRPC's fork support on, 1-2 %
    of such children died of SIGABRT before they ran (gRPC's poller, restarted in the child,
    found its descriptor closed); ``peer_elastic.etcd`` turns the support off. A fresh
    interpreter, so that gRPC is first imported the way a user's process imports it."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", SPAWN_BESIDE_BUSY_GRPC, etcd,
                          f"/{unique_job}", "600"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "codes {0: 600}" in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.alone  # any etcd server started meanwhile would sweep the dir it checks
def test_a_killed_standalone_launcher_takes_its_peers_and_its_etcd_with_it(
        unique_job: str) -> None:
    """``peer-elastic run --standalone`` SIGKILLed mid-training: its etcd shuts down and its
    peers (real ones, the README's example) end with it, nothing serves or trains on."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "peer_elastic.cli", "run", "--standalone", "--job", unique_job,
         "-n", "2", "--start-settle", "0.5", "--", *TRAIN],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    children: list[int] = []
    work_dir: Path | None = None
    try:
        banner = launcher.stderr.readline()
        found = re.search(r"on etcd ([^\s;]+) \(embedded\)", banner)
        assert found, banner
        endpoint = found.group(1)
        etcd, work_dir = _etcd_serving(f"http://{endpoint}")
        _wait_for_world(endpoint, unique_job, 2)
        children = _launcher_children(launcher.pid)
        assert etcd in children and len(children) == 3, children
        _kill_launcher_and_wait(launcher, children)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{endpoint}/health", timeout=2)
        # Its temp dir stays (nobody was left to remove it) until the next server sweeps
        # it: the launcher and its etcd, the dir's owners, have both exited.
        assert work_dir is not None and work_dir.exists()
        assert work_dir in sweep(WORK_DIR_PREFIX)
        assert not work_dir.exists()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        _kill_leftovers(children)
        if work_dir is not None and work_dir.name.startswith("peer-elastic-etcd-"):
            shutil.rmtree(work_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_killed_launcher_s_peers_leave_a_shared_etcd_gracefully(
        etcd: str, unique_job: str) -> None:
    """``peer-elastic run --etcd`` SIGKILLed: its peers get SIGTERM and leave the job (whose
    etcd is not the launcher's and lives on) as on Ctrl-C; the job has no member left."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "peer_elastic.cli", "run", "--etcd", etcd, "--job", unique_job,
         "-n", "2", "--start-settle", "0.5", "--", *TRAIN],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    children: list[int] = []
    try:
        _wait_for_world(etcd, unique_job, 2)
        children = _launcher_children(launcher.pid)
        assert len(children) == 2, children
        _kill_launcher_and_wait(launcher, children)
        r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "status", "--etcd", etcd,
                            "--job", unique_job, "--json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        # Either the job's last members ended its run, or it is there with nobody in it.
        assert r.returncode != 0 or json.loads(r.stdout)["members"] == [], r.stdout
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        _kill_leftovers(children)
