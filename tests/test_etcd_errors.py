"""What etcd can say no to, on real servers: auth (and its expiry), quota, request size."""

from __future__ import annotations

import time

import pytest

from peer_elastic.errors import EtcdAuthError, EtcdError
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd_server import EtcdServer
from tests.helpers.etcdctl import etcdctl


@pytest.fixture
def auth_etcd():
    # Simple tokens that expire after 2 s: the client must renew them by itself.
    with EtcdServer(extra_args=["--auth-token=simple", "--auth-token-ttl=2"]) as server:
        etcdctl(server, "user", "add", "root:rootpw")
        etcdctl(server, "user", "add", "peer:peerpw")
        etcdctl(server, "role", "add", "job-a")
        etcdctl(server, "role", "grant-permission", "job-a", "--prefix=true", "readwrite",
                "/peer-elastic/job-a/")
        etcdctl(server, "user", "grant-role", "peer", "job-a")
        etcdctl(server, "auth", "enable")
        yield server


def test_password_auth_works_on_plaintext_and_survives_token_expiry(auth_etcd) -> None:
    client = EtcdClient(auth_etcd.endpoint, user="peer", password="peerpw", retry_budget_s=5)
    try:
        client.put("/peer-elastic/job-a/x", b"1")
        time.sleep(3)  # the simple token expired meanwhile
        client.put("/peer-elastic/job-a/x", b"2")  # renewed transparently
        assert client.get("/peer-elastic/job-a/x").value == b"2"
        with pytest.raises(EtcdAuthError, match="refused"):
            client.put("/peer-elastic/job-b/x", b"1")  # outside its prefix
    finally:
        client.close()


def test_wrong_password_is_one_clear_error(auth_etcd) -> None:
    with pytest.raises(EtcdAuthError, match="credentials") as err:
        EtcdClient(auth_etcd.endpoint, user="peer", password="wrong", retry_budget_s=2)
    assert "_InactiveRpcError" not in str(err.value)


def test_oversized_value_is_refused_with_a_clear_error(etcd: str, unique_job: str) -> None:
    client = EtcdClient(etcd)
    try:
        with pytest.raises(EtcdError, match="too large"):
            client.put(f"/t/{unique_job}/big", b"x" * (2 << 20))  # over etcd's 1.5 MiB
    finally:
        client.close()


def test_quota_exceeded_is_a_clear_error() -> None:
    with EtcdServer(extra_args=["--quota-backend-bytes=8388608"]) as server:  # 8 MiB
        client = EtcdClient(server.endpoint, retry_budget_s=2)
        try:
            with pytest.raises(EtcdError, match="out of space") as err:
                for i in range(200):  # bounded: 200 x 512 KiB is far past the quota
                    client.put(f"/fill/{i}", b"x" * (512 << 10))
            assert "compact" in str(err.value)
        finally:
            client.close()


def test_a_roster_too_big_for_one_request_is_capped_and_the_rest_wait() -> None:
    """etcd (here with a 3 KB request limit) refuses the generation record of 40 members:
    the leader says so once, caps the roster, and the others wait as standbys."""
    from peer_elastic.config import JobSettings
    from peer_elastic.etcd.coordinator import Coordinator
    from peer_elastic.etcd.lease import LeaseKeeper
    from peer_elastic.etcd.view import JobView
    from peer_elastic.records import EventRecord, decode

    settings = JobSettings(start_settle_s=0.5, settle_s=0.05, lease_ttl_s=5, join_timeout_s=2)
    host = "a-host-name-long-enough-to-make-member-ids-big"
    with EtcdServer(extra_args=["--max-request-bytes=3000"]) as server:
        client = EtcdClient(server.endpoint, retry_budget_s=5)
        keeper = LeaseKeeper(client)
        view = JobView(client, "big")
        coords = [Coordinator(client, "big", settings, host=host, view=view, keeper=keeper)
                  for _ in range(40)]
        try:
            for c in coords:
                c.start()
            snap = view.wait_for(lambda s: s.generation is not None
                                 and set(s.generation.roster) <= s.ready_for(s.generation.number),
                                 30)
            assert snap is not None and snap.generation is not None
            roster = snap.generation.roster
            assert 1 <= len(roster) < 40
            assert "roster capped" in snap.generation.reason
            assert all(c.error is None for c in coords)
            standbys = [c for c in coords if c.assignment() is None]
            assert len(standbys) == 40 - len(roster)
            kvs, _ = client.get_prefix(coords[0].keys.events_prefix)
            events = [decode(EventRecord, kv.value, kv.key) for kv in kvs]
            told = [e for e in events if e.kind == "generation too large"]
            assert told and "--max-request-bytes" in told[0].detail
        finally:
            for c in coords:
                c.close()
            keeper.stop()
            client.close()
