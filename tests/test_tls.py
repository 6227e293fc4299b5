"""TLS credentials: checked before use, and a refused handshake says what to fix.

gRPC reports a TLS handshake refused over certificates as the same UNAVAILABLE as a server
that is down, and aborts the process on a client certificate without its key. These tests
pin what a peer gets instead (peer_elastic/etcd/tls.py): a :class:`ConfigError` for bad
files before any connection, an :class:`EtcdTLSError` naming the setting to fix within a
few seconds (not after the whole retry budget), and for a plaintext/TLS mismatch a hint on
the final "no endpoint answered" error. The real-server tests run one etcd with TLS and
client-certificate auth, and certificates the test generates.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.errors import ConfigError, EtcdTLSError, EtcdUnavailable
from peer_elastic.etcd.client import EtcdClient, client_from_env
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.tls import TLSConfig, certificate_problem, connection_hint
from peer_elastic.testing import EtcdTestServer
from tests.helpers.pki import write_pki

ROOT = Path(__file__).resolve().parent.parent
TLS_VARS = ("PEER_ELASTIC_ETCD_CA", "PEER_ELASTIC_ETCD_CERT", "PEER_ELASTIC_ETCD_KEY",
            "PEER_ELASTIC_ETCD_USER", "PEER_ELASTIC_ETCD_PASSWORD")

# --- files, before any connection ------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_pki(tmp_path_factory.mktemp("pki"), clients=("client",),
                     expired_clients=("stale",))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A second, unrelated CA and its certificates."""
    return write_pki(tmp_path_factory.mktemp("other-pki"))


def _tls(ca: Path, cert: Path | None = None, key: Path | None = None) -> TLSConfig:
    return TLSConfig(str(ca), str(cert) if cert else None, str(key) if key else None)


@pytest.mark.parametrize("case, needle", [
    ("missing CA", "PEER_ELASTIC_ETCD_CA=.*cannot read the CA certificate: No such file"),
    ("CA is a key", "PEER_ELASTIC_ETCD_CA=.*not a PEM CA certificate"),
    ("cert without key", "PEER_ELASTIC_ETCD_CERT is set but PEER_ELASTIC_ETCD_KEY is not"),
    ("key without cert", "PEER_ELASTIC_ETCD_KEY is set but PEER_ELASTIC_ETCD_CERT is not"),
    ("key is a certificate", "PEER_ELASTIC_ETCD_KEY=.*not a PEM private key"),
])
def test_bad_tls_files_are_a_config_error_before_any_connection(
        case: str, needle: str, pki: dict[str, Path], tmp_path: Path) -> None:
    tls = {
        "missing CA": _tls(tmp_path / "no-such-ca.pem"),
        "CA is a key": _tls(pki["client_key"]),
        "cert without key": _tls(pki["ca"], pki["client_cert"]),
        "key without cert": TLSConfig(str(pki["ca"]), None, str(pki["client_key"])),
        "key is a certificate": _tls(pki["ca"], pki["client_cert"], pki["client_cert"]),
    }[case]
    with pytest.raises(ConfigError, match=needle):
        tls.load()
    # The client refuses it the same way, before building a channel (port 9: nobody there).
    with pytest.raises(ConfigError, match=needle):
        EtcdClient("https://127.0.0.1:9", tls=tls, retry_budget_s=1)


def test_a_client_certificate_without_a_ca_is_refused_not_silently_unused(
        pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PEER_ELASTIC_ETCD_CERT", str(pki["client_cert"]))
    monkeypatch.setenv("PEER_ELASTIC_ETCD_KEY", str(pki["client_key"]))
    # Without the check this would connect in plaintext and never present the certificate.
    with pytest.raises(ConfigError, match="PEER_ELASTIC_ETCD_CA is not"):
        client_from_env("127.0.0.1:9")


# What gRPC 1.7x-1.8x (BoringSSL) reported in these situations, verbatim (seen with the
# real server below); the real-server tests check the same verdicts end to end.
_GRPC = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:40001: "


@pytest.mark.parametrize("details, verdict", [
    (_GRPC + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:10000412:SSL "
     "routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE", "refused this peer's client"),
    (_GRPC + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000045c:SSL "
     "routines:OPENSSL_internal:TLSV1_ALERT_CERTIFICATE_REQUIRED", "refused this peer's client"),
    (_GRPC + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000042d:SSL "
     "routines:OPENSSL_internal:SSLV3_ALERT_CERTIFICATE_EXPIRED", "expired"),
    (_GRPC + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA "
     "routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature failure",
     "does not trust etcd's certificate"),
    (_GRPC + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
     "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", "does not trust etcd's certificate"),
    (_GRPC + "Peer name 10.0.0.1 is not in peer certificate", "does not name the host"),
    (_GRPC + "Failed to create security handshaker.", "no valid PEM data, or the private key"),
    # Not certificate verdicts: a server going away, which another attempt may not see.
    (_GRPC + "Handshake read failed (Socket closed)", None),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:40001: "
     "Connection refused", None),
    ("Socket closed", None),
])
def test_certificate_problems_are_told_apart_from_outages(details: str,
                                                          verdict: str | None) -> None:
    problem = certificate_problem(details)
    if verdict is None:
        assert problem is None
    else:
        assert problem is not None and verdict in problem


def test_connection_hint_names_the_likely_mismatch() -> None:
    assert "use https://" in connection_hint("... ipv4:127.0.0.1:1: Socket closed", secure=False)
    assert "use http://" in connection_hint("Handshake read failed (Socket closed)", secure=True)
    assert connection_hint("Connection refused", secure=False) == ""
    assert connection_hint("Connection refused", secure=True) == ""


# --- a real etcd with TLS and client-certificate auth ------------------------------------------


@pytest.fixture(scope="module")
def tls_etcd(pki: dict[str, Path]) -> Iterator[EtcdTestServer]:
    srv = EtcdTestServer(cert_file=pki["server_cert"], key_file=pki["server_key"],
                     trusted_ca_file=pki["ca"], client_cert_auth=True,
                     health_client_cert=pki["client_cert"], health_client_key=pki["client_key"])
    srv.start(timeout=30)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_valid_client_certificate_registers_a_member(tls_etcd: EtcdTestServer,
                                                       pki: dict[str, Path],
                                                       unique_job: str) -> None:
    tls = _tls(pki["ca"], pki["client_cert"], pki["client_key"])
    with EtcdClient(tls_etcd.client_url, tls=tls, retry_budget_s=10) as client:
        with Coordinator(client, unique_job, JobSettings(start_settle_s=0.0)) as coord:
            assert coord.member_id in coord.snapshot().members


@pytest.mark.parametrize("case, verdict", [
    ("no client certificate", "refused this peer's client certificate"),
    ("client certificate of another CA", "refused this peer's client certificate"),
    ("expired client certificate", "refused this peer's client certificate"),
    ("server signed by a CA this peer does not trust", "does not trust etcd's certificate"),
    ("key of another certificate", "the private key does not belong to the certificate"),
])
def test_refused_credentials_fail_fast_and_say_what_to_fix(
        case: str, verdict: str, tls_etcd: EtcdTestServer, pki: dict[str, Path],
        other_pki: dict[str, Path]) -> None:
    tls = {
        "no client certificate": _tls(pki["ca"]),
        "client certificate of another CA": _tls(pki["ca"], other_pki["client_cert"],
                                                 other_pki["client_key"]),
        "expired client certificate": _tls(pki["ca"], pki["stale_cert"], pki["stale_key"]),
        "server signed by a CA this peer does not trust": _tls(
            other_pki["ca"], pki["client_cert"], pki["client_key"]),
        "key of another certificate": _tls(pki["ca"], pki["client_cert"], pki["stale_key"]),
    }[case]
    budget = 20.0
    t0 = time.monotonic()
    with EtcdClient(tls_etcd.client_url, tls=tls, retry_budget_s=budget) as client:
        with pytest.raises(EtcdTLSError) as err:
            client.get("/peer-elastic/x")
    took = time.monotonic() - t0
    msg = str(err.value)
    assert verdict in msg and tls_etcd.client_url in msg, msg
    assert "gRPC:" in msg  # gRPC's own words follow, for whoever needs the details
    # Not retried for the whole budget as if etcd were down (a few seconds, for failover).
    assert took < budget, f"{case}: {took:.1f} s"


def test_a_plaintext_client_of_a_tls_etcd_is_told_to_use_https(tls_etcd: EtcdTestServer) -> None:
    with EtcdClient(f"127.0.0.1:{tls_etcd.client_port}", retry_budget_s=1.5) as client:
        with pytest.raises(EtcdUnavailable, match="if etcd serves TLS there, use https://"):
            client.get("/peer-elastic/x")


def _cli(args: list[str], env: dict[str, str], timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in TLS_VARS}
    return subprocess.run([sys.executable, "-m", "peer_elastic.cli", *args], cwd=ROOT,
                          env=dict(clean, **env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("case, needle", [
    ("no client certificate", "refused this peer's client certificate"),
    # gRPC aborts the process (SIGABRT) on a certificate without its key: checked first.
    ("certificate without key", "PEER_ELASTIC_ETCD_KEY is not"),
])
def test_cli_with_bad_credentials_exits_2_with_one_clear_line(
        case: str, needle: str, tls_etcd: EtcdTestServer, pki: dict[str, Path]) -> None:
    env = {"PEER_ELASTIC_ETCD_CA": str(pki["ca"])}
    if case == "certificate without key":
        env["PEER_ELASTIC_ETCD_CERT"] = str(pki["client_cert"])
    r = _cli(["status", "--etcd", tls_etcd.client_url, "--job", "x"], env)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("peer-elastic:")]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
