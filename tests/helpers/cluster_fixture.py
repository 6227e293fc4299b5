"""The ``cluster`` fixture of the modules that run elastic-worker peers on the shared etcd."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from tests.helpers.procs import Cluster

#: The snapshot directory under the test's tmp_path, with ``snapshots=True``.
SNAPSHOTS = "snaps"


def cluster_fixture(settings: Mapping[str, object],
                    snapshots: bool = False) -> Callable[..., Iterator[Cluster]]:
    """A fixture named ``cluster``: a :class:`Cluster` of the test's own job on the shared
    etcd, with ``settings`` in every peer's environment, every peer killed at the end. With
    ``snapshots``, the peers write durable snapshots to ``tmp_path / SNAPSHOTS``.

    Use as ``cluster = cluster_fixture(SETTINGS)`` at a test module's top level."""

    @pytest.fixture
    def cluster(etcd: str, unique_job: str, tmp_path: Path) -> Iterator[Cluster]:
        extra = {"PEER_ELASTIC_SNAPSHOT_DIR": tmp_path / SNAPSHOTS} if snapshots else {}
        c = Cluster(etcd, unique_job, **settings, **extra)
        try:
            yield c
        finally:
            c.close()

    return cluster
