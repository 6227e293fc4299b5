"""TLS to etcd: the files checked before any channel exists, refused handshakes explained.

gRPC is a poor narrator of TLS trouble. A handshake that etcd refuses (no client
certificate, one signed by a CA etcd does not trust) or that this peer refuses (etcd's
certificate not signed by our CA) surfaces as the same UNAVAILABLE "failed to connect to all
addresses" as a server that is down, so a peer would retry for its whole budget and then
report etcd as unreachable. And a client certificate given without its key does not raise at
all: gRPC aborts the process (SIGABRT). So:

* :meth:`TLSConfig.load` reads and checks the files up front and raises :class:`ConfigError`
  naming the setting to fix;
* :func:`certificate_problem` recognises, in gRPC's error details, a handshake that failed
  over certificates: another attempt cannot fix that, so the client stops retrying soon and
  raises :class:`~peer_elastic.errors.EtcdTLSError` with the sentence it returns;
* :func:`connection_hint` adds a hint for a failure that may or may not be a TLS mismatch
  (plaintext client, TLS server, or the reverse): those look like a server going away, so
  they are retried as such, and only the final error carries the hint.

The variable names in the messages are the ones :func:`~peer_elastic.etcd.client.client_from_env`
reads, which is how every peer and CLI command gets its TLS settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer_elastic.errors import ConfigError
from peer_elastic.settings_table import ETCD_CA, ETCD_CERT, ETCD_KEY

CA_VAR, CERT_VAR, KEY_VAR = ETCD_CA.env, ETCD_CERT.env, ETCD_KEY.env


@dataclass(frozen=True)
class TLSFiles:
    """The PEM bytes gRPC needs (``cert``/``key`` both None without a client certificate)."""

    ca_cert: bytes
    cert: bytes | None
    key: bytes | None


@dataclass(frozen=True)
class TLSConfig:
    """Files for TLS: the CA that signed the servers, and an optional client cert and key."""

    ca_cert: str
    cert: str | None = None
    key: str | None = None

    def load(self) -> TLSFiles:
        """Read and check every file; :class:`ConfigError` says which one is wrong and why."""
        if (self.cert is None) != (self.key is None):
            given, missing = (CERT_VAR, KEY_VAR) if self.key is None else (KEY_VAR, CERT_VAR)
            raise ConfigError(
                f"{given} is set but {missing} is not: a client certificate needs its private "
                "key (set both, or neither when etcd does not ask for client certificates)")
        ca = _read_pem(self.ca_cert, CA_VAR, "CA certificate", b"CERTIFICATE")
        if self.cert is None or self.key is None:
            return TLSFiles(ca, None, None)
        return TLSFiles(ca, _read_pem(self.cert, CERT_VAR, "client certificate", b"CERTIFICATE"),
                        _read_pem(self.key, KEY_VAR, "private key", b"PRIVATE KEY"))


def _read_pem(path: str, var: str, what: str, label: bytes) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{var}={path}: cannot read the {what}: {exc.strerror or exc}") from None
    # "-----BEGIN CERTIFICATE-----", "-----BEGIN EC PRIVATE KEY-----", "-----BEGIN PRIVATE KEY-----"
    if b"-----BEGIN " not in data or label + b"-----" not in data:
        raise ConfigError(f"{var}={path}: not a PEM {what} (expected a "
                          f"'-----BEGIN ...{label.decode()}-----' block)")
    return data


# What gRPC (BoringSSL) puts in the details of a failed connection, lower-cased, mapped onto
# what the operator should do. Checked in order; the first match wins.
_CERTIFICATE_PROBLEMS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("failed to create security handshaker",),
     f"TLS could not be set up from the given files: one of {CA_VAR}, {CERT_VAR} or {KEY_VAR} "
     "holds no valid PEM data, or the private key does not belong to the certificate"),
    (("certificate_expired", "certificate has expired", "not yet valid"),
     "a certificate is expired or not yet valid (this peer's, or etcd's): renew it, and check "
     "that the clocks agree"),
    (("alert_certificate_required", "alert_bad_certificate", "alert_unknown_ca",
      "alert_certificate_unknown", "alert_access_denied"),
     f"etcd refused this peer's client certificate (none given, expired, or not signed by a "
     f"CA etcd trusts): etcd requires one (--client-cert-auth) signed by its --trusted-ca-file; "
     f"set {CERT_VAR} and {KEY_VAR} to a valid certificate and its key"),
    (("not in peer certificate", "hostname mismatch"),
     "etcd's certificate does not name the host this peer connects to: use an endpoint "
     "address listed in the certificate's subjectAltName, or reissue the certificate"),
    (("certificate_verify_failed", "certificate signature failure", "bad_signature",
      "unable to get local issuer", "self signed", "self-signed", "unknown_ca"),
     f"this peer does not trust etcd's certificate: {CA_VAR} must hold the CA that signed "
     "etcd's server certificate"),
)


def certificate_problem(details: str) -> str | None:
    """What to fix, when ``details`` (gRPC's) say a TLS handshake failed over certificates
    or files; None for anything else. These failures repeat identically on every attempt."""
    low = details.lower()
    for needles, advice in _CERTIFICATE_PROBLEMS:
        if any(n in low for n in needles):
            return advice
    return None


def connection_hint(details: str, secure: bool) -> str:
    """A hint (with a leading "; ") for a final "no endpoint answered" error whose last
    failure may be a TLS mismatch, else ""."""
    low = details.lower()
    if secure and ("handshake read failed" in low or "wrong_version_number" in low):
        return ("; if etcd serves plaintext there, use http:// (or host:port) endpoints and "
                f"unset {CA_VAR}")
    if not secure and "socket closed" in low:
        return (f"; if etcd serves TLS there, use https:// endpoints and set {CA_VAR} (and "
                f"{CERT_VAR}/{KEY_VAR} when it asks for client certificates)")
    return ""
