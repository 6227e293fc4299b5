"""A throwaway PKI for TLS tests, made by the recipe operators use: ``deploy/etcd/make-certs.sh``.

So the certificates every real-etcd TLS test runs on are the ones the deployment recipe
produces (a CA, etcd's server and peer certificates, client certificates by CN), and a
change to the recipe that etcd or a peer-elastic client would refuse fails those tests.
Only expired certificates, which the recipe never makes, are signed here with ``openssl ca``
by the same CA. Needs ``openssl`` (tests skip without it); EC P-256 keys, so it is quick.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MAKE_CERTS = ROOT / "deploy" / "etcd" / "make-certs.sh"
#: What the local test servers are reached as.
LOOPBACK_SANS = ("127.0.0.1", "localhost")

__all__ = ["LOOPBACK_SANS", "MAKE_CERTS", "make_certs", "openssl", "write_pki"]


def openssl() -> str:
    """The openssl binary; skips the test when there is none."""
    found = shutil.which("openssl")
    if found is None:
        pytest.skip("openssl is not installed (Debian/Ubuntu: apt-get install openssl)")
    return found


def make_certs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``make-certs.sh`` with ``args``; AssertionError with its output if it fails."""
    openssl()
    proc = subprocess.run(["sh", str(MAKE_CERTS), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"make-certs.sh {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def _openssl_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y%m%d%H%M%SZ")


def _sign_expired(directory: Path, cn: str) -> None:
    """``<cn>.crt``/``.key``: a client certificate of the CA in ``directory`` that expired an
    hour ago (``openssl ca`` can set both dates; ``openssl x509 -req`` only a length)."""
    work = directory / f".expired-{cn}"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "ext.cnf").write_text(
        "[ ca ]\ndefault_ca = test_ca\n"
        "[ test_ca ]\n"
        f"database = {work}/index.txt\nnew_certs_dir = {work}\nrand_serial = yes\n"
        "default_md = sha256\npolicy = any\nunique_subject = no\n"
        "[ any ]\ncommonName = supplied\n"
        "[ client ]\nbasicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\nextendedKeyUsage = clientAuth\n")
    now = datetime.datetime.now(datetime.timezone.utc)
    key, csr = directory / f"{cn}.key", work / "req.csr"
    ssl = openssl()
    for argv in (
        [ssl, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", str(key)],
        [ssl, "req", "-new", "-key", str(key), "-subj", f"/CN={cn}", "-out", str(csr)],
        [ssl, "ca", "-batch", "-config", str(work / "ext.cnf"), "-extensions", "client",
         "-cert", str(directory / "ca.crt"), "-keyfile", str(directory / "ca.key"),
         "-startdate", _openssl_time(now - datetime.timedelta(days=1)),
         "-enddate", _openssl_time(now - datetime.timedelta(hours=1)),
         "-notext", "-in", str(csr), "-out", str(directory / f"{cn}.crt")],
    ):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stdout}{proc.stderr}"
    key.chmod(0o600)
    shutil.rmtree(work)


def write_pki(directory: Path, *, clients: Iterable[str] = ("client",),
              expired_clients: Iterable[str] = (),
              sans: Sequence[str] = LOOPBACK_SANS) -> dict[str, Path]:
    """Run the recipe into ``directory`` and return the PEM files' paths by label.

    Labels: ``ca`` (and ``ca_key``); ``server_cert`` / ``server_key`` and ``peer_cert`` /
    ``peer_key`` (SANs ``sans``: 127.0.0.1 and localhost by default); ``root_cert`` /
    ``root_key`` (CN root); ``<cn>_cert`` / ``<cn>_key`` for each client CN; the same for
    each CN in ``expired_clients``, whose certificate expired an hour ago.
    """
    directory.mkdir(parents=True, exist_ok=True)
    make_certs("--out", str(directory), *sans)
    for cn in clients:
        make_certs("client", "--out", str(directory), cn)
    for cn in expired_clients:
        _sign_expired(directory, cn)
    paths = {"ca": directory / "ca.crt", "ca_key": directory / "ca.key"}
    for name in ("server", "peer", "root", *clients, *expired_clients):
        paths[f"{name}_cert"] = directory / f"{name}.crt"
        paths[f"{name}_key"] = directory / f"{name}.key"
    return paths
