"""Runtime control and the event log, on a real etcd: set, pause, resume, events."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import ConfigError
from peer_elastic.etcd.admin import update_config
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@pytest.fixture
def coords(etcd: str, unique_job: str):
    made: list[tuple[Coordinator, EtcdClient]] = []

    def start(**settings) -> Coordinator:
        client = EtcdClient(etcd)
        c = Coordinator(client, unique_job, JobSettings(**{**FAST, **settings})).start()
        made.append((c, client))
        return c

    yield start
    for c, client in made:
        c.close()
        client.close()


def roster_of(c: Coordinator, size: int):
    snap = c.view.wait_for(lambda s: s.generation is not None and len(s.generation.roster) == size,
                           15)
    assert snap is not None, f"no generation of size {size}"
    return snap.generation


def test_set_resizes_a_running_job_and_later_peers_adopt_it(coords, etcd, unique_job) -> None:
    a = coords(max_np=2)
    b = coords(max_np=2)
    s = coords(max_np=2)
    roster_of(a, 2)
    assert s.assignment() is None  # standby
    r = cli("set", "--etcd", etcd, "--job", unique_job, "max_np=3", "min_np=1")
    assert r.returncode == 0, r.stderr
    assert "max_np=3" in r.stdout
    gen = roster_of(a, 3)  # no restart: the standby is promoted by the new max_np
    assert s.member_id in gen.roster and b.member_id in gen.roster
    late = coords(max_np=2)  # an old environment file: adopts max_np=3 instead of failing
    assert late.config.max_np == 3
    events = cli("events", "--etcd", etcd, "--job", unique_job, "--json")
    kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines()]
    assert "settings changed" in kinds and "joined" in kinds and "generation" in kinds


def test_pause_freezes_joins_but_not_departures(coords, etcd, unique_job) -> None:
    a, b = coords(), coords()
    roster_of(a, 2)
    assert cli("pause", "--etcd", etcd, "--job", unique_job).returncode == 0
    c = coords()
    a.view.wait_for(lambda snap: snap.run.config.paused and c.member_id in snap.members, 10)
    assert c.member_id not in a.latest_generation.roster  # waits as a standby
    b.close()  # a departure is still handled while paused
    gen = roster_of(a, 1)
    assert list(gen.roster) == [a.member_id]
    assert cli("resume", "--etcd", etcd, "--job", unique_job).returncode == 0
    gen = roster_of(a, 2)
    assert list(gen.roster) == [a.member_id, c.member_id]


@pytest.mark.parametrize("assignment, text", [
    ("lease_ttl_s=3", "cannot change while the job runs"),
    ("max_nodes=3", "unknown setting"),
    ("min_np=two", "not a valid int"),
    ("min_np=5", "max_np (2) is smaller than min_np (5)"),
    ("nonsense", "expected NAME=VALUE"),
])
def test_set_refuses_bad_changes_with_one_line(coords, etcd, unique_job, assignment, text) -> None:
    coords(max_np=2)
    r = cli("set", "--etcd", etcd, "--job", unique_job, assignment)
    assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr


def test_update_config_on_an_unknown_job(etcd: str) -> None:
    client = EtcdClient(etcd)
    try:
        with pytest.raises(ConfigError, match="no running run"):
            update_config(client, "no-such-job-anywhere", {"min_np": 2})
    finally:
        client.close()


def test_events_follow_prints_new_events(coords, etcd, unique_job) -> None:
    a = coords()
    roster_of(a, 1)
    proc = subprocess.Popen([sys.executable, "-m", "peer_elastic.cli", "events", "--etcd", etcd,
                             "--job", unique_job, "--follow"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline()  # the existing log comes first
        assert "joined" in first or "generation" in first
        coords()  # a new member: its join and the generation appear while following
        seen = ""
        for _ in range(20):
            seen += proc.stdout.readline()
            if "joined:" in seen:
                break
        assert "joined:" in seen
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_status_shows_when_each_member_was_last_seen(coords, etcd, unique_job) -> None:
    a = coords(lease_ttl_s=6)
    roster_of(a, 1)
    doc = json.loads(cli("status", "--etcd", etcd, "--job", unique_job, "--json").stdout)
    (member,) = doc["members"]
    # Seconds since its last lease keep-alive: refreshed about every TTL/3, counted to the
    # second by etcd; a live member is never near its TTL.
    assert isinstance(member["last_seen_s"], int) and 0 <= member["last_seen_s"] <= 3
    text = cli("status", "--etcd", etcd, "--job", unique_job).stdout
    assert re.search(rf"{a.member_id} .* seen \d+ s ago", text), text
