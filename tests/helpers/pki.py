"""A throwaway PKI for TLS tests: a CA, an etcd server certificate and client certificates.

Everything is generated per test with ``cryptography`` (a test dependency; tests skip
without it), with EC P-256 keys, so it takes milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from pathlib import Path

import pytest


def write_pki(directory: Path, *, clients: Iterable[str] = ("client",),
              expired_clients: Iterable[str] = ()) -> dict[str, Path]:
    """Write PEM files under ``directory`` and return their paths by label.

    Labels: ``ca``; ``server_cert`` / ``server_key`` (SAN 127.0.0.1 and localhost, usable
    for server and client auth, as etcd's health checks need); ``<cn>_cert`` / ``<cn>_key``
    for each client CN, valid for a day; the same for each CN in ``expired_clients``, whose
    certificate expired an hour ago.
    """
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    hour, day = datetime.timedelta(hours=1), datetime.timedelta(days=1)
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label: str, data: bytes) -> None:
        path = directory / f"{label}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        paths[label] = path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("peer-elastic test CA"))
        .issuer_name(name("peer-elastic test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - hour)
        .not_valid_after(now + day)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(label: str, cn: str, usages: list[x509.ObjectIdentifier],
             not_before: datetime.datetime, not_after: datetime.datetime) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(f"{label}_cert", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{label}_key", key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))

    leaf("server", "etcd", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
         now - hour, now + day)
    for cn in clients:
        leaf(cn, cn, [ExtendedKeyUsageOID.CLIENT_AUTH], now - hour, now + day)
    for cn in expired_clients:
        leaf(cn, cn, [ExtendedKeyUsageOID.CLIENT_AUTH], now - day, now - hour)
    return paths
