"""A durable snapshot's staging copy, rank 0's work on the training thread at a due commit:
it is not a hang however long it takes, and when it fails (out of memory, a device error)
that snapshot is skipped, counted and said, and training goes on.

Unit tests of the writer with a state whose copy raises; then a real peer over a real etcd
whose staging copies fail twice, then take longer than hang_timeout_s, then work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.durable.writer import SnapshotInfo, SnapshotWriter, Staging
from tests.helpers.durable import Listener, make_state
from tests.helpers.fakes import FakeClock
from tests.helpers.procs import Cluster
from tests.helpers.worker_lines import results

INFO = SnapshotInfo("r1-abc", 3, 2)


@pytest.mark.parametrize("error", [MemoryError("no memory"),
                                   torch.OutOfMemoryError("CUDA out of memory"),
                                   ValueError("anything else")])
def test_a_failed_staging_copy_skips_that_snapshot_and_the_next_due_one_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Exception) -> None:
    clock = FakeClock()
    listener = Listener()
    directory = SnapshotDir(tmp_path, "job-a")
    writer = SnapshotWriter(directory, every_s=10, keep=3, listener=listener, clock=clock)
    state = make_state(0)
    released: list[Staging] = []
    real_capture, real_release = Staging.capture, Staging.release

    def failing(self: Staging, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        real_capture(self, tensors)  # buffers allocated, then the copy fails
        raise error

    def release(self: Staging) -> None:
        released.append(self)
        real_release(self)

    monkeypatch.setattr(Staging, "capture", failing)
    monkeypatch.setattr(Staging, "release", release)
    clock.now += 10
    with caplog.at_level("WARNING", logger="peer_elastic.durable.writer"):
        assert not writer.offer(state, INFO)  # no raise: training goes on
    assert len(listener.errors) == 1 and listener.errors[0] is error
    said = [r.getMessage() for r in caplog.records if "snapshot skipped" in r.getMessage()]
    assert len(said) == 1 and type(error).__name__ in said[0] and str(error) in said[0]
    assert len(released) == 1  # the buffers went back
    assert not writer.busy and directory.names() == []
    assert not writer.offer(state, INFO)  # not at every commit: at the next due one
    assert len(listener.errors) == 1
    monkeypatch.undo()
    clock.now += 10
    assert writer.offer(state, INFO)  # the next due commit tries again, and it works
    assert writer.wait_idle(60)
    assert len(listener.results) == 1 and len(directory.names()) == 1
    writer.close()


def test_a_state_that_fails_to_give_its_tensors_skips_that_snapshot(tmp_path: Path) -> None:
    listener = Listener()
    writer = SnapshotWriter(SnapshotDir(tmp_path, "job-a"), every_s=10, keep=3,
                            listener=listener)
    state = make_state(0)

    class Broken:
        commit_count = 1

        def durable_state(self) -> tuple[dict[str, torch.Tensor], dict]:
            raise RuntimeError("device lost")

    assert not writer.offer(Broken(), INFO, force=True)
    assert len(listener.errors) == 1
    assert writer.offer(state, INFO, force=True)  # not turned off for good
    assert writer.wait_idle(60) and len(listener.results) == 1
    writer.close()


def test_the_staging_copy_runs_inside_hang_exempt(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    inside: list[bool] = []
    depth = [0]

    @contextlib.contextmanager
    def exempt() -> Iterator[None]:
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    real_capture = Staging.capture

    def watched(self: Staging, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inside.append(depth[0] == 1)
        return real_capture(self, tensors)

    monkeypatch.setattr(Staging, "capture", watched)
    writer = SnapshotWriter(SnapshotDir(tmp_path, "job-a"), every_s=10, keep=3,
                            hang_exempt=exempt)
    assert writer.offer(make_state(0), INFO, force=True)
    assert writer.wait_idle(60)
    assert inside == [True] and depth[0] == 0
    writer.close()


# -- the real thing -----------------------------------------------------------------------

HANG_TIMEOUT = 2.0


@pytest.mark.slow
def test_a_peer_whose_staging_fails_trains_on_and_writes_the_next_snapshot(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    # One real peer on gloo, real etcd: its first two staging copies fail (MemoryError, then
    # torch's out-of-memory error), the third takes twice hang_timeout_s, the rest work. A
    # checkpoint of its own, marked hang_exempt, takes twice hang_timeout_s too. Neither
    # fences it; the job finishes exactly once and snapshots are on disk.
    snaps = tmp_path / "snaps"
    c = Cluster(etcd, unique_job, PEER_ELASTIC_SNAPSHOT_DIR=snaps,
                PEER_ELASTIC_SNAPSHOT_EVERY=0.3, PEER_ELASTIC_HANG_TIMEOUT=HANG_TIMEOUT,
                PEER_ELASTIC_LEASE_TTL=5, PEER_ELASTIC_START_SETTLE=0.2,
                PEER_ELASTIC_COLLECTIVE_TIMEOUT=60, PEER_ELASTIC_MIN_NP=1,
                WORKER_SAMPLES=320, WORKER_EPOCHS=2, WORKER_STEP_S=0.02,
                WORKER_STAGING=f"memory,oom,sleep:{2 * HANG_TIMEOUT}",
                WORKER_EXEMPT_AT=f"1:10:{2 * HANG_TIMEOUT}")
    try:
        (peer,) = c.start(1)
        assert peer.wait(240) == 0, peer.output()
        out = peer.output()
    finally:
        c.close()
    assert "peer-elastic: hung" not in out, out
    assert "STAGING memory" in out and "STAGING oom" in out and "STAGING sleep" in out, out
    assert "EXEMPT 1 10" in out, out
    skipped = [line for line in out.splitlines() if "durable snapshot skipped" in line]
    assert len(skipped) == 2, out  # said once each, with the cause
    assert "MemoryError" in skipped[0] and "OutOfMemoryError" in skipped[1], skipped
    (result,) = results([peer])
    assert result["exact"] and result["identical"], result
    assert result["snapshots_failed"] == 2, result
    newest = SnapshotDir(snaps, unique_job).newest_valid()
    assert newest is not None and newest.id.commits > 0
