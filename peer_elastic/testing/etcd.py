"""What only tests need of etcd: TLS, extra client addresses, raft status, clusters.

Built on :class:`peer_elastic.etcd_server.EtcdServer` (what ``peer-elastic run --standalone``
runs). :class:`EtcdTestServer` adds TLS, extra client addresses and raft status;
:class:`EtcdCluster` runs N of them as one raft cluster, with handles to inject member
failures. Used by the test suite, ``benchmarks/`` and ``examples/chaos_demo.py``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import ssl
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from peer_elastic import etcd_server
from peer_elastic.etcd_server import (
    LOOPBACK,
    PORT_RETRIES,
    EtcdServer,
    EtcdStartError,
    http_request,
)

__all__ = ["EtcdCluster", "EtcdTestServer"]

PathLike = str | os.PathLike[str]


class EtcdTestServer(EtcdServer):
    """An :class:`EtcdServer` with the options tests need.

    TLS: pass ``cert_file`` and ``key_file`` to serve clients over https (peer traffic stays
    plain http on loopback). ``trusted_ca_file`` plus ``client_cert_auth=True`` makes etcd
    demand client certificates; then ``health_client_cert``/``health_client_key`` are
    required, because the readiness check has to present one too. The readiness check does
    not verify the server certificate: it talks to our own child on loopback and checks
    liveness, not identity.

    ``extra_client_hosts`` (IP addresses) makes etcd also serve clients on those addresses,
    same port, e.g. one on a veth that a test can cut for a peer in another network
    namespace. Health checks and ``endpoint`` stay on 127.0.0.1.

    Every other keyword argument is :class:`EtcdServer`'s.
    """

    def __init__(
        self,
        data_dir: PathLike | None = None,
        *,
        cert_file: PathLike | None = None,
        key_file: PathLike | None = None,
        trusted_ca_file: PathLike | None = None,
        client_cert_auth: bool = False,
        health_client_cert: PathLike | None = None,
        health_client_key: PathLike | None = None,
        extra_client_hosts: Sequence[str] = (),
        **server_kwargs: Any,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if client_cert_auth and (cert_file is None or trusted_ca_file is None):
            raise ValueError("client_cert_auth needs cert_file, key_file and trusted_ca_file")
        if client_cert_auth and (health_client_cert is None or health_client_key is None):
            raise ValueError(
                "client_cert_auth=True needs health_client_cert and health_client_key: "
                "etcd refuses the /health readiness check without a client certificate"
            )
        if (health_client_cert is None) != (health_client_key is None):
            raise ValueError("health_client_cert and health_client_key must be given together")
        if isinstance(extra_client_hosts, str):
            raise TypeError("extra_client_hosts is a sequence of IP addresses, not one string")
        try:  # etcd listens on IP addresses only
            self.extra_client_hosts = [str(ipaddress.ip_address(h)) for h in extra_client_hosts]
        except ValueError as exc:
            raise ValueError(f"extra_client_hosts: {exc}") from None
        self.cert_file = os.fspath(cert_file) if cert_file is not None else None
        self.key_file = os.fspath(key_file) if key_file is not None else None
        self.trusted_ca_file = os.fspath(trusted_ca_file) if trusted_ca_file is not None else None
        self.client_cert_auth = client_cert_auth
        self._health_cert: tuple[str, str] | None = None
        if health_client_cert is not None and health_client_key is not None:
            self._health_cert = (os.fspath(health_client_cert), os.fspath(health_client_key))
        super().__init__(data_dir, **server_kwargs)

    @property
    def scheme(self) -> str:
        """``"https"`` when serving clients over TLS, else ``"http"``."""
        return "https" if self.cert_file else "http"

    @property
    def client_urls(self) -> list[str]:
        """Every URL etcd serves clients on: ``client_url``, then one per extra client host."""
        extra = [f"[{h}]" if ":" in h else h for h in self.extra_client_hosts]
        return [self.client_url] + [f"{self.scheme}://{h}:{self.client_port}" for h in extra]

    def command(self) -> list[str]:
        cmd = super().command()
        if self.cert_file:
            cmd += [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.trusted_ca_file:
            cmd.append(f"--trusted-ca-file={self.trusted_ca_file}")
        if self.client_cert_auth:
            cmd.append("--client-cert-auth")
        return cmd

    def ssl_context(self) -> ssl.SSLContext | None:
        """Client-side SSL context for HTTP requests to this member (None without TLS)."""
        if not self.cert_file:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if self._health_cert is not None:
            ctx.load_cert_chain(*self._health_cert)
        return ctx

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        """This member's ``Maintenance.Status`` via etcd's JSON gateway.

        Lets tests find the leader (``status()["leader"] == status()["header"]["member_id"]``)
        without a gRPC client. IDs come back as decimal strings.
        """
        status, payload = http_request(
            self.client_url + "/v3/maintenance/status",
            body=b"{}",
            timeout=timeout,
            ssl_context=self.ssl_context(),
        )
        if status != 200:
            raise RuntimeError(f"status of {self.endpoint} failed: HTTP {status}: {payload!r}")
        return json.loads(payload)

    def is_leader(self, timeout: float = 2.0) -> bool:
        """True iff this member is the raft leader right now."""
        st = self.status(timeout)
        return str(st.get("leader")) == str(st.get("header", {}).get("member_id"))


class EtcdCluster:
    """``size`` etcd members on loopback, forming one raft cluster.

    Members are spawned together and only then waited for, since no member reports healthy
    before a quorum of them is up. ``kill(i)`` and ``start_member(i)`` inject member
    failures; ``stop()`` stops all members and deletes their temp data.

    Extra keyword arguments are passed to every :class:`EtcdTestServer` (e.g. ``log_level``,
    ``unsafe_no_fsync``, ``extra_args``).
    """

    def __init__(self, size: int = 3, **server_kwargs: Any) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        for forbidden in ("name", "client_port", "peer_port", "initial_cluster", "data_dir"):
            if forbidden in server_kwargs:
                raise TypeError(f"EtcdCluster chooses {forbidden!r} per member")
        self.size = size
        self._started_once = False
        token = server_kwargs.pop("initial_cluster_token", None) or (
            f"peer-elastic-{secrets.token_hex(4)}"
        )
        ports = etcd_server.free_ports(2 * size)
        initial_cluster = self._initial_cluster(ports)
        self.members: list[EtcdTestServer] = [
            EtcdTestServer(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                initial_cluster=initial_cluster,
                initial_cluster_token=token,
                **server_kwargs,
            )
            for i in range(size)
        ]

    @staticmethod
    def _initial_cluster(ports: Sequence[int]) -> str:
        return ",".join(
            f"m{i}=http://{LOOPBACK}:{ports[2 * i + 1]}" for i in range(len(ports) // 2)
        )

    @property
    def endpoints(self) -> list[str]:
        """``["127.0.0.1:PORT", ...]``, one per member, in member order."""
        return [m.endpoint for m in self.members]

    @property
    def endpoint_string(self) -> str:
        """The endpoints joined by commas, as peer-elastic's ``--etcd`` option takes them."""
        return ",".join(self.endpoints)

    @property
    def client_urls(self) -> list[str]:
        """``http(s)://127.0.0.1:PORT`` per member."""
        return [m.client_url for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Spawn every member, then wait until every member is healthy.

        If the first start fails because a port was taken between probing and binding, the
        whole cluster is re-planned on fresh ports (member IDs depend on the peer URLs, so
        half-initialised data dirs are wiped first).

        Raises:
            EtcdStartError: some member exited or stayed unhealthy; all members are
                killed before it is raised.
        """
        deadline = time.monotonic() + timeout
        for attempt in range(PORT_RETRIES):
            for member in self.members:
                member.start(wait=False)
            try:
                for member in self.members:
                    member.wait_ready(max(0.0, deadline - time.monotonic()))
                self._started_once = True
                return self
            except EtcdStartError:
                for member in self.members:
                    member.kill()
                retry = attempt + 1 < PORT_RETRIES and self._may_retry_on_new_ports()
                if not retry:
                    raise
                self._replan_ports()
        raise AssertionError("unreachable")  # pragma: no cover

    def _may_retry_on_new_ports(self) -> bool:
        # Some members may have been healthy (2 of 3 make a quorum) but the cluster as a
        # whole never was; its data dirs are wiped before the retry, so that is fine.
        return (
            not self._started_once
            and all(m.owns_data for m in self.members)
            and any(m.port_conflict() for m in self.members)
        )

    def _replan_ports(self) -> None:
        ports = etcd_server.free_ports(2 * self.size)
        initial_cluster = self._initial_cluster(ports)
        for i, member in enumerate(self.members):
            member.replan_ports((ports[2 * i], ports[2 * i + 1]), initial_cluster)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (data kept); the rest keep running."""
        self.members[i].kill()

    def start_member(self, i: int, timeout: float = 30.0, *, wait: bool = True) -> EtcdTestServer:
        """Restart member ``i`` on its old data dir and ports.

        With ``wait`` it blocks until the member is healthy again, which needs a quorum: to
        bring back several members of a cluster that lost quorum, start them with
        ``wait=False`` and then call ``wait_ready()`` on each.
        """
        return self.members[i].start(timeout, wait=wait)

    def leader_index(self, timeout: float = 2.0) -> int | None:
        """Index of the member that is leader now, or None if no running member knows one."""
        for i, member in enumerate(self.members):
            if not member.running:
                continue
            try:
                if member.is_leader(timeout):
                    return i
            except (OSError, RuntimeError, ValueError):
                continue
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every member and delete their temp data. Safe to call more than once."""
        # A leader that gets SIGTERM first hands leadership to a follower and waits for it;
        # if the followers are dying too, it waits ~6 s for nothing. So the followers go
        # first (together), then the leader, which finds no peer to hand over to.
        leader = self.leader_index(timeout=1.0) if self.size > 1 else None
        order = [i for i in range(self.size) if i != leader]
        for i in order:
            self.members[i].send_signal(signal.SIGTERM)
        if leader is not None:
            order.append(leader)
        errors: list[BaseException] = []
        for member in (self.members[i] for i in order):
            try:
                member.stop(timeout)
            except Exception as exc:  # stop the others even if one misbehaves
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EtcdCluster(size={self.size}, endpoints={self.endpoint_string!r})"
