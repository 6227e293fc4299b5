"""A network namespace wired to the host by two veth links, for network-partition tests.

::

    host network namespace                       namespace pe-<hex>
    pe<hex>g0  10.213.A.B+1/30  --- gloo link ---  pe<hex>g1  10.213.A.B+2/30
    pe<hex>e0  10.214.A.B+1/30  --- etcd link ---  pe<hex>e1  10.214.A.B+2/30

etcd also listens on the host end of the etcd link (``EtcdTestServer(extra_client_hosts=...)`` from peer_elastic.testing),
and a peer inside the namespace is given that address as its etcd endpoint. Training
traffic goes over the gloo link only: every peer sets ``GLOO_SOCKET_IFNAME`` to its end of
it (host peers: ``pe<hex>g0``; the namespace's peer: ``pe<hex>g1``). So :meth:`cut_etcd`
partitions the namespace from etcd and from nothing else.

The cut is a silent drop, like a real partition (no RST, no ICMP, no local error): a
``pfifo limit 0`` qdisc on both ends of the etcd link discards every packet, and
:meth:`heal_etcd` deletes them, so open TCP connections survive and resume. Only if the
kernel refuses that qdisc is a blackhole route inside the namespace used instead (sends then
fail locally, which is less realistic but still a cut).

Everything is created under fresh random names, nothing outside what this class creates is
touched, every command has a timeout, and :meth:`close` (also on ``__exit__``) kills what
still runs inside the namespace, by PID, and deletes the namespace and the links.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.helpers.place import Place

_CMD_TIMEOUT_S = 15.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot build the topology (not root, no ``ip``, no netns or veth)."""


def unavailable_reason() -> str | None:
    """Why a namespace cannot be built here, or None if it is worth trying."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and veth links needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def run_cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(args)}` timed out after {_CMD_TIMEOUT_S} s") from exc
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the host already has addresses or routes in (to avoid overlaps)."""
    nets = []
    for cmd in (("ip", "-4", "-o", "addr", "show"), ("ip", "-4", "route", "show", "table", "all")):
        for word in run_cmd(*cmd, check=False).stdout.split():
            if word[:1].isdigit() and "." in word:
                try:
                    nets.append(ipaddress.IPv4Network(word, strict=False))
                except ValueError:
                    pass
    return nets


@dataclass(frozen=True)
class Link:
    """One veth pair: host end and namespace end, with their addresses."""

    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str
    prefix: int = 30


class Netns:
    """The namespace and its two links; see the module docstring. Use as a context manager."""

    def __init__(self) -> None:
        tag = secrets.token_hex(4)
        self.name = f"pe-{tag}"
        a, b = self._free_subnet()
        self.gloo = Link(f"pe{tag}g0", f"pe{tag}g1", f"10.213.{a}.{b + 1}", f"10.213.{a}.{b + 2}")
        self.etcd = Link(f"pe{tag}e0", f"pe{tag}e1", f"10.214.{a}.{b + 1}", f"10.214.{a}.{b + 2}")
        self.cut_mode = "drop"
        self.is_cut = False
        self._created: list[str] = []  # what close() must undo: "netns", host link names

    @staticmethod
    def _free_subnet() -> tuple[int, int]:
        taken = host_networks()
        for _ in range(64):
            a, b = random.randrange(256), 4 * random.randrange(64)
            mine = [ipaddress.IPv4Network(f"10.{x}.{a}.{b}/30") for x in (213, 214)]
            if not any(m.overlaps(t) for m in mine for t in taken if t.prefixlen > 0):
                return a, b
        raise NetnsUnavailable("no free /30 subnet in 10.213/16 and 10.214/16")

    # -- building -------------------------------------------------------------------------------

    def create(self) -> Netns:
        """Build the namespace and links. Raises :class:`NetnsUnavailable` (after cleaning
        up) when the kernel or the sandbox does not allow namespaces or veth links."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            r = run_cmd("ip", "netns", "add", self.name, check=False)
            if r.returncode != 0:
                raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
            self._created.append("netns")
            self._ns("ip", "link", "set", "lo", "up")
            for link in (self.gloo, self.etcd):
                r = run_cmd("ip", "link", "add", link.host_if, "type", "veth", "peer", "name",
                         link.ns_if, "netns", self.name, check=False)
                if r.returncode != 0:
                    raise NetnsUnavailable(f"creating a veth pair failed: {r.stderr.strip()}")
                self._created.append(link.host_if)
                run_cmd("ip", "addr", "add", f"{link.host_ip}/{link.prefix}", "dev", link.host_if)
                run_cmd("ip", "link", "set", link.host_if, "up")
                self._ns("ip", "addr", "add", f"{link.ns_ip}/{link.prefix}", "dev", link.ns_if)
                self._ns("ip", "link", "set", link.ns_if, "up")
            # Probe the silent-drop qdisc once; fall back to a blackhole route without it.
            r = run_cmd("tc", "qdisc", "add", "dev", self.etcd.host_if, "root", "pfifo", "limit", "0",
                     check=False) if shutil.which("tc") else None
            if r is None or r.returncode != 0:
                self.cut_mode = "blackhole"
            else:
                run_cmd("tc", "qdisc", "del", "dev", self.etcd.host_if, "root")
            self._wait_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Block until both links pass traffic (veth carrier and DAD settle quickly)."""
        deadline = time.monotonic() + timeout
        for link in (self.gloo, self.etcd):
            with socket.socket() as srv:
                srv.bind((link.host_ip, 0))
                srv.listen()
                port = srv.getsockname()[1]
                while True:
                    r = self._ns(sys.executable, "-c",
                                 f"import socket; socket.create_connection(({link.host_ip!r}, "
                                 f"{port}), timeout=2).close()", check=False)
                    if r.returncode == 0:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{link.ns_if} cannot reach {link.host_ip}: {r.stderr}")
                    time.sleep(0.2)

    def _ns(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_cmd("ip", "netns", "exec", self.name, *args, check=check)

    # -- using ----------------------------------------------------------------------------------

    @property
    def place(self) -> Place:
        """Inside the namespace (a peer there: :class:`tests.helpers.procs.PeerProc`)."""
        return Place(self.name)

    def cut_etcd(self) -> None:
        """Partition the namespace from etcd (the etcd link only)."""
        if self.cut_mode == "drop":
            run_cmd("tc", "qdisc", "add", "dev", self.etcd.host_if, "root", "pfifo", "limit", "0")
            self._ns("tc", "qdisc", "add", "dev", self.etcd.ns_if, "root", "pfifo", "limit", "0")
        else:
            self._ns("ip", "route", "replace", "blackhole", f"{self.etcd.host_ip}/32")
        self.is_cut = True

    def heal_etcd(self) -> None:
        """Undo :meth:`cut_etcd`."""
        if self.cut_mode == "drop":
            self._ns("tc", "qdisc", "del", "dev", self.etcd.ns_if, "root")
            run_cmd("tc", "qdisc", "del", "dev", self.etcd.host_if, "root")
        else:
            self._ns("ip", "route", "del", "blackhole", f"{self.etcd.host_ip}/32")
        self.is_cut = False

    def pids(self) -> list[int]:
        """PIDs of the processes running inside the namespace."""
        r = run_cmd("ip", "netns", "pids", self.name, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs inside, delete the namespace and links. Idempotent, never raises."""
        if "netns" in self._created:
            kill_all(self.pids)
            run_cmd("ip", "netns", "del", self.name, check=False)
        # Deleting the namespace destroys its veth ends and with them the pairs; delete the
        # host ends too in case a pair outlived it (e.g. the ns end was never moved).
        for name in self._created:
            if name != "netns":
                run_cmd("ip", "link", "del", name, check=False)
        self._created.clear()

    def __enter__(self) -> Netns:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Netns({self.name!r}, gloo={self.gloo}, etcd={self.etcd}, cut={self.cut_mode})"


# -- who talks to whom ------------------------------------------------------------------------------


def kill_all(pids: Callable[[], list[int]], tries: int = 20) -> None:
    """SIGKILL every process ``pids()`` lists until it lists none (bounded: ``tries`` rounds
    0.1 s apart), e.g. everything inside a namespace before it is deleted."""
    for _ in range(tries):
        left = pids()
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def tcp_connections(pid: int) -> list[tuple[str, int, str, int]]:
    """Established TCP connections owned by process ``pid``: (local ip, port, remote ip, port).

    Read from ``/proc/<pid>/net/tcp`` (the process's network namespace), keeping only rows
    whose socket inode is one of the process's open file descriptors.
    """
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def addr(hex_addr: str) -> tuple[str, int]:
        ip_hex, port_hex = hex_addr.split(":")
        raw = b"".join(int(ip_hex[i:i + 8], 16).to_bytes(4, "little")
                       for i in range(0, len(ip_hex), 8))
        ip = ipaddress.ip_address(raw)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # gRPC's dual-stack sockets
        return str(ip), int(port_hex, 16)

    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "01" and cols[9] in inodes:  # 01 = ESTABLISHED
                out.append((*addr(cols[1]), *addr(cols[2])))
    return out
