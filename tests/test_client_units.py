"""Pieces of the etcd layer that need no server: endpoints, settings, error mapping."""

from __future__ import annotations

import pytest

from peer_elastic.config import JobSettings, validate
from peer_elastic.errors import ConfigError, EtcdError
from peer_elastic.etcd.client import EndpointSpec, parse_endpoints
from peer_elastic.etcd.keys import RunKeys, job_prefix


def test_parse_endpoints_forms() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://h2:1234,https://h3") == [
        EndpointSpec("127.0.0.1", 2379, False),
        EndpointSpec("h2", 1234, False),
        EndpointSpec("h3", 2379, True),
    ]
    assert parse_endpoints("[::1]:4000") == [EndpointSpec("::1", 4000, False)]


@pytest.mark.parametrize("bad", ["", " , ", "ftp://x:1", "h:port", "h:0", "h:70000", "/x"])
def test_parse_endpoints_rejects_bad_input_with_the_item(bad: str) -> None:
    with pytest.raises(EtcdError):
        parse_endpoints(bad)


def test_settings_from_env_and_overrides() -> None:
    env = {"PEER_ELASTIC_MIN_NP": "2", "PEER_ELASTIC_LEASE_TTL": "7.5"}
    s = JobSettings.from_env(env, max_np=4)
    assert (s.min_np, s.max_np, s.lease_ttl_s, s.join_timeout_s) == (2, 4, 7.5, None)
    cfg = s.resolved()
    assert cfg.join_timeout_s == 1.0 and cfg.max_np == 4


def test_settings_errors_are_actionable() -> None:
    with pytest.raises(ConfigError, match="PEER_ELASTIC_MIN_NP"):
        JobSettings.from_env({"PEER_ELASTIC_MIN_NP": "two"})
    with pytest.raises(ConfigError, match="unknown job setting"):
        JobSettings.from_env({}, min_nodes=2)
    with pytest.raises(ConfigError, match="max_np .3. is smaller than min_np .4."):
        JobSettings(min_np=4, max_np=3).resolved()
    cfg = JobSettings().resolved()
    cfg.lease_ttl_s = 0.5
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        validate(cfg)


def test_job_names_are_validated() -> None:
    with pytest.raises(ConfigError, match="invalid job name"):
        job_prefix("../other-job")
    assert RunKeys("j", "r1").member("m") == "/peer-elastic/j/r1/members/m"
