"""Peers forked by a prefork server (tests/helpers/prefork.py) are processes as their own
programs would be: the harness sees the same pid, exit codes, signals and output, and the
peer sees the same process, environment and interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import prefork
from tests.helpers.hosts import hosts_or_skip
from tests.helpers.place import Place
from tests.helpers.procs import ROOT, PeerProc, gone

PROBE = "tests.helpers.prefork_probe"
WAIT_S = 60.0


def probe_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PEER_ELASTIC_JOB="probe", **extra)


def described(p: PeerProc) -> dict:
    return json.loads(p.wait_line("PROBE ", timeout=WAIT_S).split(" ", 1)[1])


#: This module's own servers: the pool shared by a pytest process serves the first few
#: startup environments its tests asked for, and these tests may come after them.
POOL = prefork.Pool(max_groups=1)


@pytest.fixture(scope="module", autouse=True)
def _close_pool() -> Iterator[None]:
    yield
    POOL.close()


def forked(*args: str, env: dict[str, str] | None = None) -> PeerProc:
    p = PeerProc([sys.executable, "-m", PROBE, *args], env or probe_env(), "forked",
                 forked=True, pool=POOL)
    assert isinstance(p.proc, prefork.ForkedProcess)
    return p


def test_a_forked_peer_is_the_process_its_own_program_would_be(tmp_path: Path) -> None:
    env = probe_env(WORKER_SAMPLES="7")
    own = PeerProc([sys.executable, "-m", PROBE], env, "own")
    peer = forked(env=env)
    try:
        a, b = described(own), described(peer)
        assert own.wait(WAIT_S) == 0 and peer.wait(WAIT_S) == 0
    finally:
        own.kill()
        peer.kill()
    assert b["pid"] == peer.pid != os.getpid()
    assert b["sid"] == b["pgid"] == b["pid"]  # its own session and process group
    assert b["env"] == a["env"] == env
    assert b["cwd"] == a["cwd"] == str(ROOT)
    assert b["argv"] == a["argv"] and b["argv"][0].endswith("prefork_probe.py")
    assert b["path0"] == a["path0"] and b["name"] == a["name"] == "__main__"
    assert b["fds"] == a["fds"]  # nothing of the server's left open
    assert b["stdin"] == "/dev/null" and b["stdout_is_stderr"] and a["stdout_is_stderr"]
    assert not b["grpc"] and b["threads"] == a["threads"] == 1


def test_exit_codes_and_signals_reach_the_harness() -> None:
    peers = [forked("exit", "3"), forked("raise"), forked("wait"), forked("wait"),
             forked("linger")]
    try:
        code3, raised, killed, stopped, linger = peers
        assert code3.wait(WAIT_S) == 3
        assert raised.wait(WAIT_S) == 1
        assert "RuntimeError: the probe raised" in raised.output()  # stderr: same pipe
        described(killed)
        killed.signal(signal.SIGKILL)
        assert killed.wait(WAIT_S) == -signal.SIGKILL
        described(stopped)
        stopped.signal(signal.SIGSTOP)
        with pytest.raises(subprocess.TimeoutExpired):
            stopped.proc.wait(0.5)
        assert stopped.proc.poll() is None
        stopped.signal(signal.SIGCONT)
        stopped.signal(signal.SIGTERM)
        assert stopped.wait(WAIT_S) == -signal.SIGTERM
        assert linger.wait(WAIT_S) == 0
        linger.wait_line("AT-EXIT", timeout=WAIT_S)  # the interpreter's own exit ran
    finally:
        for p in peers:
            p.kill()


def test_an_exited_peer_stays_a_zombie_until_the_harness_reads_its_exit() -> None:
    # As a child of the harness's own would: its pid is not reused while the test may
    # still signal it.
    p = forked("exit", "0")
    try:
        described(p)
        deadline = time.monotonic() + WAIT_S
        while not gone(p.pid):  # exited: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert Path(f"/proc/{p.pid}").exists()
        assert p.wait(WAIT_S) == 0
        deadline = time.monotonic() + WAIT_S
        while Path(f"/proc/{p.pid}").exists():  # reaped once read
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.kill()


def test_peers_started_one_after_the_other_draw_their_own_seeds() -> None:
    peers = [forked(), forked()]
    try:
        a, b = (described(p) for p in peers)
        for p in peers:
            assert p.wait(WAIT_S) == 0
    finally:
        for p in peers:
            p.kill()
    assert a["str_hash"] != b["str_hash"]  # different servers: different hash seeds
    assert a["numpy_draw"] != b["numpy_draw"]


def test_a_different_startup_environment_gets_a_server_of_its_own() -> None:
    env = probe_env(OMP_NUM_THREADS="1")  # read by OpenMP as torch is imported
    assert prefork.startup_env(env) != prefork.startup_env(probe_env())
    assert prefork.startup_env(probe_env(WORKER_X="1")) == prefork.startup_env(probe_env())
    pool = prefork.Pool(servers_per_group=1, max_groups=1)
    argv = [sys.executable, "-m", PROBE]
    try:
        proc = pool.start(argv, env)
        assert isinstance(proc, prefork.ForkedProcess)
        assert pool.start(argv, probe_env()) is None  # beyond max_groups: its own program
        assert proc.wait(WAIT_S) == 0
        assert json.loads(proc.stdout.read().split(" ", 1)[1])["env"]["OMP_NUM_THREADS"] == "1"
    finally:
        pool.close()


def test_without_prefork_a_peer_is_its_own_program(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prefork.ENABLE_ENV, "0")
    p = PeerProc([sys.executable, "-m", PROBE], probe_env(), "own", forked=True, pool=POOL)
    try:
        assert isinstance(p.proc, subprocess.Popen)
        assert described(p)["ppid"] == os.getpid()
        assert p.wait(WAIT_S) == 0
    finally:
        p.kill()


@pytest.mark.parametrize("where", ["host", "netns"])
def test_a_peer_forked_elsewhere_is_where_ip_netns_exec_puts_its_own_program(
        where: str) -> None:
    """A test host (network namespace, hostname, /etc/hosts) or a bare network namespace:
    what a forked peer sees there is what the same program sees, started by the commands."""
    with hosts_or_skip(1, "a peer on a test host") as hosts:
        host = hosts.hosts[0]
        place = host.place if where == "host" else Place(host.netns)
        argv = [sys.executable, "-m", PROBE]
        own = PeerProc(argv, probe_env(), "own", place=place)
        peer = PeerProc(argv, probe_env(), "forked", forked=True, pool=POOL, place=place)
        try:
            assert isinstance(peer.proc, prefork.ForkedProcess)
            assert not isinstance(own.proc, prefork.ForkedProcess)
            a, b = described(own), described(peer)
            assert own.wait(WAIT_S) == 0 and peer.wait(WAIT_S) == 0
        finally:
            own.kill()
            peer.kill()
    here = {"netns": os.readlink("/proc/self/ns/net"), "uts": os.readlink("/proc/self/ns/uts")}
    for key in ("netns", "hostname", "etc_hosts", "interfaces", "sys_class_net"):
        assert b[key] == a[key], key
    assert b["netns"] != here["netns"] and host.ns_if in b["interfaces"]
    assert b["sys_class_net"] == b["interfaces"]  # the namespace's own /sys
    if where == "host":
        # a UTS namespace of its own, as each `unshare --uts` makes
        assert b["hostname"] == host.name and here["uts"] != b["uts"] != a["uts"]
        assert f"127.0.1.1\t{host.name}" in b["etc_hosts"]
    else:
        assert b["uts"] == a["uts"] == here["uts"]
    assert b["pid"] == peer.pid and b["threads"] == 1 and not b["grpc"]
