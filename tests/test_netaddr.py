"""Address selection (peer_elastic.process.netaddr) on this machine's loopback; the multi-host
behaviour is tests/test_multihost.py's."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from peer_elastic.errors import ConfigError
from peer_elastic.process.netaddr import (
    GLOO_IFNAME,
    interface_addresses,
    plain_ip,
    probe,
    select_address,
)
from peer_elastic.process.probe_listener import ProbeListener


@pytest.fixture(autouse=True)
def _no_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PEER_ELASTIC_ADDR", "PEER_ELASTIC_IFNAME", GLOO_IFNAME, "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_interfaces_include_loopback() -> None:
    assert ("lo", "127.0.0.1") in interface_addresses()


def test_loopback_endpoint_changes_nothing(listener: int) -> None:
    env: dict[str, str] = {}
    choice = select_address([("127.0.0.1", listener)], environ=env)
    assert choice.address == "127.0.0.1" and choice.ifname is None
    assert env == {}


def test_ipv6_loopback_endpoint() -> None:
    if not socket.has_ipv6 or "::1" not in [ip for _, ip in interface_addresses()]:
        pytest.skip("no IPv6 loopback here")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        s.listen()
        env: dict[str, str] = {}
        choice = select_address([("::1", s.getsockname()[1])], environ=env)
    assert choice.address == "::1" and env == {}
    p = ProbeListener("::1")
    try:
        assert probe("::1", p.port, timeout=1) is None
    finally:
        p.close()


def test_forced_address_sets_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEER_ELASTIC_ADDR", "127.0.0.1")
    env: dict[str, str] = {}
    choice = select_address([], environ=env)
    assert (choice.address, choice.ifname) == ("127.0.0.1", "lo")
    assert env[GLOO_IFNAME] == "lo"


def test_forced_address_not_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEER_ELASTIC_ADDR", "192.0.2.77")
    with pytest.raises(ConfigError, match="192.0.2.77 is not an address of this machine"):
        select_address([], environ={})


def test_unknown_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEER_ELASTIC_IFNAME", "nosuchif0")
    with pytest.raises(ConfigError, match="nosuchif0"):
        select_address([], environ={})


def test_user_gloo_ifname_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {GLOO_IFNAME: "lo"}
    choice = select_address([], environ=env)
    assert choice.ifname is None and choice.address == "127.0.0.1"
    assert env == {GLOO_IFNAME: "lo"}


def test_probe() -> None:
    p = ProbeListener("127.0.0.1")
    try:
        assert probe("127.0.0.1", p.port, timeout=1) is None
    finally:
        p.close()
    assert probe("127.0.0.1", p.port, timeout=1, attempts=1) is not None


def test_plain_ip_compares_addresses_as_written() -> None:
    assert plain_ip("[fd15::11]") == "fd15::11"
    assert plain_ip("fe80::1%eth0") == "fe80::1"
    assert plain_ip("::ffff:10.0.0.2") == "10.0.0.2"  # an IPv4 peer on a dual-stack socket
    assert plain_ip("::ffff:a00:2") == "::ffff:a00:2"  # written as hex: left as it is
    assert plain_ip("10.0.0.2") == "10.0.0.2"
