"""Pieces of the etcd layer that need no server: endpoints, settings, error mapping."""

from __future__ import annotations

import pytest

from peer_elastic.config import JobSettings, validate
from peer_elastic.errors import ConfigError, EtcdError
from peer_elastic.etcd.client import EndpointSpec, parse_endpoints
from peer_elastic.etcd.keys import JobKeys, KeyKind, ParsedKey, RunKeys, job_prefix, parse


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


def test_parse_is_the_inverse_of_the_builders() -> None:
    k = RunKeys("j", "r1")
    cases = {
        JobKeys("j").run_key: ParsedKey(KeyKind.RUN, "j"),
        k.member("m-1"): ParsedKey(KeyKind.MEMBER, "j", "r1", "m-1"),
        k.generation: ParsedKey(KeyKind.GENERATION, "j", "r1"),
        k.ready(3, "m"): ParsedKey(KeyKind.READY, "j", "r1", "m", 3),
        k.broken(3, "m"): ParsedKey(KeyKind.BROKEN, "j", "r1", "m", 3),
        k.alive(3, "m"): ParsedKey(KeyKind.ALIVE, "j", "r1", "m", 3),
        k.store_prefix(4) + "a/b": ParsedKey(KeyKind.STORE, "j", "r1", "a/b", 4),
        k.arrivals_prefix(4) + "m": ParsedKey(KeyKind.ARRIVED, "j", "r1", "m", 4),
        k.drain("m"): ParsedKey(KeyKind.DRAIN, "j", "r1", "m"),
        k.fenced("m"): ParsedKey(KeyKind.FENCED, "j", "r1", "m"),
        k.failures("h"): ParsedKey(KeyKind.FAILURES, "j", "r1", "h"),
        k.blacklist("h"): ParsedKey(KeyKind.BLACKLIST, "j", "r1", "h"),
        k.progress: ParsedKey(KeyKind.PROGRESS, "j", "r1"),
        k.state: ParsedKey(KeyKind.STATE, "j", "r1"),
        k.done: ParsedKey(KeyKind.DONE, "j", "r1"),
        k.event("m", 42): ParsedKey(KeyKind.EVENT, "j", "r1", f"{42:020d}-m"),
    }
    for key, want in cases.items():
        assert parse(key) == want, key
    assert k.event("w") <= k.event("w")  # event keys sort by time
    for junk in ["/elsewhere/j/run", "/peer-elastic/j/", "/peer-elastic/j/r1/members",
                 "/peer-elastic/j/r1/members/a/b", "/peer-elastic/j/r1/gen/x/ready/m",
                 "/peer-elastic/j/r1/gen/1/other/m", "/peer-elastic/j/r1/nope",
                 "/peer-elastic/../run"]:
        assert parse(junk) is None, junk
