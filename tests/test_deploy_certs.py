"""deploy/etcd/make-certs.sh, run with the real openssl: what it writes is a CA and the
certificates etcd and its clients need, with the names and usages each one needs.

That a real etcd accepts a peer-elastic client with them is checked where every TLS test
gets its certificates from this script (tests/helpers/pki.py): tests/test_tls.py,
tests/test_etcd_server.py, and the 3-member cluster of tests/test_deploy.py.
"""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers.pki import MAKE_CERTS, make_certs, openssl

SANS = ("etcd-1.example.internal", "*.etcd.ns.svc", "192.0.2.11", "127.0.0.1", "::1",
        "localhost")
WRITTEN = ("ca", "server", "peer", "client", "root")


def x509_text(cert: Path) -> str:
    proc = subprocess.run([openssl(), "x509", "-in", str(cert), "-noout", "-text"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def extension(text: str, name: str) -> str:
    """The value line of an X509v3 extension in ``openssl x509 -text``."""
    m = re.search(rf"X509v3 {name}:(?: critical)?[ ]*\n\s+(.*)", text)
    assert m, f"no {name} in\n{text}"
    return m.group(1).strip()


def subject_cn(cert: Path) -> str:
    proc = subprocess.run([openssl(), "x509", "-in", str(cert), "-noout", "-subject",
                           "-nameopt", "multiline"], capture_output=True, text=True, timeout=30)
    m = re.search(r"commonName\s*=\s*(.+)$", proc.stdout, re.M)
    assert m, proc.stdout
    return m.group(1).strip()


def verifies(ca: Path, cert: Path, purpose: str) -> bool:
    proc = subprocess.run([openssl(), "verify", "-CAfile", str(ca), "-purpose", purpose,
                           str(cert)], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "pki"
    make_certs("--out", str(out), "--client-cn", "peer-elastic-resnet50", *SANS)
    return out


def test_script_is_posix_shell() -> None:
    proc = subprocess.run(["sh", "-n", str(MAKE_CERTS)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert MAKE_CERTS.stat().st_mode & stat.S_IXUSR


def test_writes_every_certificate_and_key_private(pki: Path) -> None:
    for name in WRITTEN:
        assert (pki / f"{name}.crt").is_file()
        assert stat.S_IMODE((pki / f"{name}.key").stat().st_mode) == 0o600, name


def test_ca_signs_everything_and_only_the_ca_is_a_ca(pki: Path) -> None:
    ca = pki / "ca.crt"
    assert extension(x509_text(ca), "Basic Constraints") == "CA:TRUE"
    for name in ("server", "peer"):
        assert verifies(ca, pki / f"{name}.crt", "sslserver"), name
        assert verifies(ca, pki / f"{name}.crt", "sslclient"), name
    for name in ("client", "root"):
        assert verifies(ca, pki / f"{name}.crt", "sslclient"), name
        assert not verifies(ca, pki / f"{name}.crt", "sslserver"), f"{name} is a client only"
    for name in WRITTEN[1:]:
        assert extension(x509_text(pki / f"{name}.crt"), "Basic Constraints") == "CA:FALSE"


def test_server_and_peer_certificates_carry_the_sans_given(pki: Path) -> None:
    expected = ", ".join(
        f"IP Address:{'0:0:0:0:0:0:0:1' if s == '::1' else s}" if s[0].isdigit() or ":" in s
        else f"DNS:{s}" for s in SANS)
    for name in ("server", "peer"):
        assert extension(x509_text(pki / f"{name}.crt"), "Subject Alternative Name") == expected


def test_client_certificates_name_their_etcd_users(pki: Path) -> None:
    # With etcd auth, the CN is the etcd user a certificate logs in as.
    assert subject_cn(pki / "client.crt") == "peer-elastic-resnet50"
    assert subject_cn(pki / "root.crt") == "root"
    assert "Subject Alternative Name" not in x509_text(pki / "client.crt")


def test_another_client_from_the_same_ca_and_a_rerun_keeps_the_ca(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    make_certs("--out", str(out), "127.0.0.1")
    ca_before = (out / "ca.crt").read_bytes()
    old_client = tmp_path / "old-client.crt"
    old_client.write_bytes((out / "client.crt").read_bytes())
    make_certs("client", "--out", str(out), "peer-elastic-job2", "job2")
    assert subject_cn(out / "job2.crt") == "peer-elastic-job2"
    assert verifies(out / "ca.crt", out / "job2.crt", "sslclient")
    make_certs("--out", str(out), "127.0.0.1", "etcd-4.example.internal")
    # Certificates handed out before stay valid: the CA is reused, not replaced.
    assert (out / "ca.crt").read_bytes() == ca_before
    assert verifies(out / "ca.crt", old_client, "sslclient")
    assert "DNS:etcd-4.example.internal" in x509_text(out / "server.crt")


def test_days_sets_the_leaf_validity(tmp_path: Path) -> None:
    make_certs("--out", str(tmp_path), "--days", "30", "localhost")
    proc = subprocess.run([openssl(), "x509", "-in", str(tmp_path / "server.crt"), "-noout",
                           "-checkend", str(29 * 86400)], capture_output=True, text=True)
    assert proc.returncode == 0  # valid in 29 days
    proc = subprocess.run([openssl(), "x509", "-in", str(tmp_path / "server.crt"), "-noout",
                           "-checkend", str(31 * 86400)], capture_output=True, text=True)
    assert proc.returncode == 1  # expired in 31


@pytest.mark.parametrize("args, needle", [
    ([], "give the SANs"),
    (["--days", "x", "localhost"], "--days"),
    (["--days", "0", "localhost"], "--days"),
    (["--client-cn", "a/b", "localhost"], "bad common name"),
    (["--bogus", "localhost"], "usage"),
    (["client"], "usage"),
    (["client", "x", "../escape"], "bad file name"),
])
def test_bad_arguments_exit_2_and_say_why(args: list[str], needle: str, tmp_path: Path) -> None:
    openssl()
    proc = subprocess.run(["sh", str(MAKE_CERTS), *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert needle in proc.stderr, proc.stderr


def test_client_needs_an_existing_ca(tmp_path: Path) -> None:
    openssl()
    proc = subprocess.run(["sh", str(MAKE_CERTS), "client", "--out", str(tmp_path / "none"),
                           "someone"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no CA" in proc.stderr, proc
