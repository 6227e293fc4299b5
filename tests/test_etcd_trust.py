"""What a writer of the job's etcd prefix cannot do: point a peer at files of its choosing
(``snapshot_dir`` is per peer), set values no peer could be started with (run-record
settings pass the same rules as local ones), or smuggle a newline into a key name."""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings, validate
from peer_elastic.durable.layout import SnapshotDir
from peer_elastic.errors import ConfigError, RecordError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.keys import JobKeys
from peer_elastic.records import JobConfig, RunRecord, decode, encode, valid_name
from peer_elastic.setting_rules import MAX_DURATION_S, setting_problem
from tests.helpers.procs import Cluster, assert_exactly_once

FAST = dict(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0, min_np=1)


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["job\n", "a\n", "h-1-abc\n", "x\r", "\njob", "a\nb"])
def test_a_name_with_a_newline_is_refused(name: str) -> None:
    assert not valid_name(name)
    assert valid_name(name.replace("\n", "").replace("\r", ""))


# -- one set of rules for local settings and the run record -----------------------------------


BAD_SETTINGS = [
    ("hang_timeout_s", 0.05), ("hang_timeout_s", -1.0), ("join_timeout_s", -1.0),
    ("join_timeout_s", 0.0), ("elastic_timeout_s", -5.0), ("settle_s", -0.1),
    ("lease_ttl_s", 0.5), ("lease_ttl_s", 1e12), ("run_ttl_s", MAX_DURATION_S * 2),
    ("blacklist_cooldown_s", math.inf), ("snapshot_every_s", math.nan),
    ("min_np", 0), ("min_np", 4_000_000_000), ("max_np", 2_000_000),
]


def _run_record(**config: object) -> RunRecord:
    run = RunRecord(run_id="r1", lease_id=1)
    run.config.CopyFrom(JobSettings().resolved())
    for name, value in config.items():
        setattr(run.config, name, value)
    return run


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_a_value_refused_locally_is_refused_in_a_run_record_with_the_same_reason(
        name: str, value: object) -> None:
    cfg = _run_record(**{name: value}).config
    problem = setting_problem(cfg)
    assert problem is not None and problem.setting == name, problem
    with pytest.raises(ConfigError) as local:
        validate(cfg)
    with pytest.raises(RecordError) as remote:
        decode(RunRecord, encode(_run_record(**{name: value})), "/peer-elastic/j/run")
    assert str(problem) in str(local.value)
    assert str(problem) in str(remote.value) and "/peer-elastic/j/run" in str(remote.value)


def test_hang_timeout_is_off_or_at_least_a_second() -> None:
    for ok in (0.0, 1.0, 30.0):
        assert decode(RunRecord, encode(_run_record(hang_timeout_s=ok))).config \
            .hang_timeout_s == ok
    with pytest.raises(ConfigError, match="hang_timeout_s must be 0 .off. or at least 1 s"):
        JobSettings(hang_timeout_s=0.5).resolved()


def test_a_run_record_from_before_the_snapshot_settings_reads_their_defaults() -> None:
    run = _run_record()
    run.config.ClearField("snapshot_every_s")
    run.config.ClearField("snapshot_keep")
    back = decode(RunRecord, encode(run))
    assert back.config.snapshot_every_s == JobSettings().resolved().snapshot_every_s
    assert back.config.snapshot_keep == JobSettings().resolved().snapshot_keep


# -- snapshot_dir is this peer's own ----------------------------------------------------------


def test_snapshot_dir_comes_from_the_peer_never_from_the_run() -> None:
    theirs = _run_record(snapshot_dir="/attacker/dir").config
    assert JobSettings().for_this_peer(theirs).snapshot_dir == ""
    assert JobSettings(snapshot_dir="/mine").for_this_peer(theirs).snapshot_dir == "/mine"
    # Everything else is the run's, as before.
    theirs.join_timeout_s = 7.0
    assert JobSettings().for_this_peer(theirs).join_timeout_s == 7.0
    # A different directory is no disagreement (hosts mount shared storage differently).
    JobSettings(snapshot_dir="/mine").check_against(theirs, "j")
    with pytest.raises(ConfigError, match="join_timeout_s"):
        JobSettings(join_timeout_s=2.0).check_against(theirs, "j")
    assert "none" in JobSettings().per_peer_differences(theirs)[0]
    assert "/mine" in JobSettings(snapshot_dir="/mine").per_peer_differences(theirs)[0]
    assert JobSettings(snapshot_dir="/attacker/dir").per_peer_differences(theirs) == []


@pytest.fixture
def client(etcd: str) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd, retry_budget_s=10)
    yield c
    c.close()


def plant_run(client: EtcdClient, job: str, settings: JobSettings, **config: object) -> RunRecord:
    """Write ``job``'s run record as someone with write access to the prefix would."""
    cfg = JobConfig()
    cfg.CopyFrom(settings.resolved())
    for name, value in config.items():
        setattr(cfg, name, value)
    run = RunRecord(run_id=f"r{int(time.time())}-{secrets.token_hex(4)}",
                    lease_id=client.grant(cfg.run_ttl_s), created_unix=time.time(),
                    created_by="intruder")
    run.config.CopyFrom(cfg)
    client.put(JobKeys(job).run_key, encode(run), run.lease_id)
    return run


def test_a_peer_never_adopts_the_run_records_snapshot_dir(
        client: EtcdClient, etcd: str, unique_job: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    settings = JobSettings(**FAST)
    plant_run(client, unique_job, settings, snapshot_dir=str(tmp_path / "planted"))
    peer_client = EtcdClient(etcd, retry_budget_s=10)
    coord = Coordinator(peer_client, unique_job, settings)
    try:
        with caplog.at_level(logging.WARNING, logger="peer_elastic.etcd.registration"):
            coord.start()
        assert coord.config.snapshot_dir == ""
        assert any("writes and resumes from no durable snapshots" in r.getMessage()
                   and "PEER_ELASTIC_SNAPSHOT_DIR" in r.getMessage() for r in caplog.records)
        # Still its own after the coordination loop adopted the watched run record (it does
        # so in the step in which it leads, before it writes the first generation).
        assert coord.view.wait_for(lambda s: s.generation is not None, 15) is not None
        assert coord.config.snapshot_dir == "" and coord.config.join_timeout_s == 1.0
    finally:
        coord.close()
        peer_client.close()


def test_a_run_record_with_a_refused_setting_is_not_joined_and_never_crashes_the_watcher(
        client: EtcdClient, etcd: str, unique_job: str) -> None:
    settings = JobSettings(**FAST)
    plant_run(client, unique_job, settings, hang_timeout_s=0.05)
    peer_client = EtcdClient(etcd, retry_budget_s=10)
    try:
        with pytest.raises(ConfigError, match="hang_timeout_s must be 0"):
            Coordinator(peer_client, unique_job, settings).start()
    finally:
        peer_client.close()


def test_a_refused_setting_written_into_a_running_run_is_ignored(
        client: EtcdClient, etcd: str, unique_job: str) -> None:
    peer_client = EtcdClient(etcd, retry_budget_s=10)
    coord = Coordinator(peer_client, unique_job, JobSettings(**FAST))
    try:
        coord.start()
        assert coord.view.wait_for(lambda s: s.generation is not None, 15) is not None
        kv = client.get(JobKeys(unique_job).run_key)
        run = decode(RunRecord, kv.value, kv.key)
        run.config.join_timeout_s = -1.0
        client.put(kv.key, run.SerializeToString(), run.lease_id)
        snap = coord.view.wait_for(lambda s: kv.key in coord.view.malformed, 10)
        assert snap is not None, "the refused record was not reported"
        assert "join_timeout_s must be positive" in coord.view.malformed[kv.key]
        assert coord.view.snapshot().run.config.join_timeout_s == 1.0
        assert coord.config.join_timeout_s == 1.0
        # The watcher lives on: a valid change still arrives.
        run.config.join_timeout_s = 2.0
        client.put(kv.key, encode(run), run.lease_id)
        assert coord.view.wait_for(lambda s: s.run.config.join_timeout_s == 2.0, 10)
    finally:
        coord.close()
        peer_client.close()


@pytest.mark.slow
def test_a_real_peer_snapshots_into_its_own_dir_never_the_run_records(
        client: EtcdClient, etcd: str, unique_job: str, tmp_path: Path) -> None:
    env = {"PEER_ELASTIC_LEASE_TTL": "3", "PEER_ELASTIC_JOIN_TIMEOUT": "1.5",
           "PEER_ELASTIC_START_SETTLE": "0.5", "PEER_ELASTIC_SNAPSHOT_EVERY": "0.5"}
    planted, own = tmp_path / "planted", tmp_path / "own"
    plant_run(client, unique_job, JobSettings.from_env(env), snapshot_dir=str(planted))
    cluster = Cluster(etcd, unique_job, PEER_ELASTIC_SNAPSHOT_DIR=own, WORKER_SAMPLES=320,
                      WORKER_EPOCHS=2, WORKER_STEP_S=0.03, **env)
    try:
        peers = cluster.start(1)
        assert_exactly_once(peers, timeout=180)
        assert SnapshotDir(str(own), unique_job).names(), peers[0].output()
        assert not planted.exists(), "the peer wrote into the run record's snapshot_dir"
        assert "this peer uses its own" in peers[0].output()
    finally:
        cluster.close()
