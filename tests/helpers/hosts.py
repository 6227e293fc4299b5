"""Several "hosts" on one bridge, as real clusters look to a peer, for multi-host tests.

::

    host network namespace: bridge pb<hex>  10.215.A.1/24  fd15:A::1/64   (etcd listens here)
      ├── veth  ──  namespace pe-<hex>-1:  10.215.A.11/24  fd15:A::11/64   hostname host1
      ├── veth  ──  namespace pe-<hex>-2:  10.215.A.12/24  fd15:A::12/64   hostname host2
      └── ...

A peer runs in its host's network namespace, in a UTS namespace with that host's name and
in a mount namespace where ``/etc/hosts`` is the one Debian and Ubuntu ship: the hostname
maps to 127.0.1.1 (the trap that makes gloo advertise a loopback address). Nothing in the
environment tells a peer which interface to use.

:meth:`Hosts.cut` partitions one host from everything (a silent drop: a ``pfifo limit 0``
qdisc on both ends of its veth, else the link taken down), :meth:`Hosts.cut_from_peers`
from the other hosts only (etcd, on the bridge, stays reachable), :meth:`Hosts.cut_from_etcd`
from the bridge's own addresses only (etcd; the other hosts stay reachable);
:meth:`Hosts.heal` undoes any of them.
Everything is created under fresh random names; :meth:`Hosts.close` kills what still runs
inside the namespaces and deletes them, the links and the bridge.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.helpers.netns import (
    NetnsUnavailable,
    host_networks,
    kill_all,
    run_cmd,
    unavailable_reason,
)
from tests.helpers.place import Place

__all__ = ["Host", "Hosts", "NetnsUnavailable", "hosts_or_skip", "unavailable_reason"]


@dataclass
class Host:
    name: str  # hostname inside, e.g. host1
    netns: str
    host_if: str  # veth end in the host namespace (on the bridge)
    ns_if: str  # veth end inside the namespace
    ip4: str
    ip6: str
    hosts_file: str
    # "" while not cut; "drop" or "down" (cut), "peers" (cut_from_peers), "etcd"
    # (cut_from_etcd)
    cut_mode: str = ""

    @property
    def place(self) -> Place:
        """This host: its network, hostname and /etc/hosts."""
        return Place(self.netns, self.name, self.hosts_file)


class Hosts:
    """``n`` namespaces on one bridge; see the module docstring. A context manager."""

    def __init__(self, n: int, ipv6: bool = True, ipv4: bool = True) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"pb{self.tag}"
        self.subnet = self._free_subnet()
        self.ipv6 = ipv6
        self.ipv4 = ipv4
        self.bridge_ip4 = f"10.215.{self.subnet}.1"
        self.bridge_ip6 = f"fd15:{self.subnet:x}::1"
        self._dir = tempfile.mkdtemp(prefix="pe-hosts-")
        self.hosts = [self._host(i) for i in range(1, n + 1)]
        self._created: list[str] = []  # "br", "ns:<name>", "if:<name>"

    def _host(self, i: int) -> Host:
        name = f"host{i}"
        path = os.path.join(self._dir, f"{name}.hosts")
        with open(path, "w") as f:  # what Debian/Ubuntu images ship
            f.write(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n\n"
                    "::1\tlocalhost ip6-localhost ip6-loopback\n")
        return Host(name, f"pe-{self.tag}-{i}", f"pv{self.tag}{i}", f"pw{self.tag}{i}",
                    f"10.215.{self.subnet}.{10 + i}", f"fd15:{self.subnet:x}::{10 + i:x}", path)

    @staticmethod
    def _free_subnet() -> int:
        taken = host_networks()
        for _ in range(64):
            a = random.randrange(256)
            mine = ipaddress.IPv4Network(f"10.215.{a}.0/24")
            if not any(mine.overlaps(t) for t in taken if t.prefixlen > 0):
                return a
        raise NetnsUnavailable("no free /24 subnet in 10.215/16")

    def create(self) -> Hosts:
        reason = unavailable_reason() or (None if shutil.which("unshare") else
                                          "the `unshare` command (util-linux) is missing")
        if reason:
            raise NetnsUnavailable(reason)
        try:
            r = run_cmd("ip", "link", "add", self.bridge, "type", "bridge", check=False)
            if r.returncode != 0:
                raise NetnsUnavailable(f"creating a bridge failed: {r.stderr.strip()}")
            self._created.append("br")
            if self.ipv4:
                run_cmd("ip", "addr", "add", f"{self.bridge_ip4}/24", "dev", self.bridge)
            if self.ipv6:
                run_cmd("ip", "-6", "addr", "add", f"{self.bridge_ip6}/64", "dev", self.bridge,
                     "nodad")
            run_cmd("ip", "link", "set", self.bridge, "up")
            for h in self.hosts:
                r = run_cmd("ip", "netns", "add", h.netns, check=False)
                if r.returncode != 0:
                    raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
                self._created.append(f"ns:{h.netns}")
                r = run_cmd("ip", "link", "add", h.host_if, "type", "veth", "peer", "name",
                         h.ns_if, "netns", h.netns, check=False)
                if r.returncode != 0:
                    raise NetnsUnavailable(f"creating a veth pair failed: {r.stderr.strip()}")
                self._created.append(f"if:{h.host_if}")
                run_cmd("ip", "link", "set", h.host_if, "master", self.bridge)
                run_cmd("ip", "link", "set", h.host_if, "up")
                ns = ("ip", "netns", "exec", h.netns)
                run_cmd(*ns, "ip", "link", "set", "lo", "up")
                if self.ipv4:
                    run_cmd(*ns, "ip", "addr", "add", f"{h.ip4}/24", "dev", h.ns_if)
                if self.ipv6:
                    run_cmd(*ns, "ip", "-6", "addr", "add", f"{h.ip6}/64", "dev", h.ns_if, "nodad")
                run_cmd(*ns, "ip", "link", "set", h.ns_if, "up")
            self._wait_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_reachable(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            for ip in ([self.bridge_ip4] if self.ipv4 else []) + \
                    ([self.bridge_ip6] if self.ipv6 else []):
                while True:
                    r = run_cmd("ip", "netns", "exec", h.netns, "ping", "-c", "1", "-W", "1", ip,
                             check=False) if shutil.which("ping") else self._py_probe(h, ip)
                    if r.returncode == 0:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{h.name} cannot reach {ip}: {r.stdout}{r.stderr}")
                    time.sleep(0.2)

    @staticmethod
    def _py_probe(h: Host, ip: str):  # type: ignore[no-untyped-def]
        fam = "AF_INET6" if ":" in ip else "AF_INET"
        code = (f"import socket; s = socket.socket(socket.{fam}, socket.SOCK_DGRAM); "
                f"s.connect(({ip!r}, 9)); s.send(b'x')")
        return run_cmd("ip", "netns", "exec", h.netns, sys.executable, "-c", code, check=False)

    # -- events --------------------------------------------------------------------------------

    def cut(self, h: Host) -> None:
        """Partition ``h`` from every other host and from etcd (silent drop)."""
        if shutil.which("tc"):
            r = run_cmd("tc", "qdisc", "add", "dev", h.host_if, "root", "pfifo", "limit", "0",
                     check=False)
            if r.returncode == 0:
                run_cmd("ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.ns_if,
                     "root", "pfifo", "limit", "0")
                h.cut_mode = "drop"
                return
        run_cmd("ip", "link", "set", h.host_if, "down")
        h.cut_mode = "down"

    def cut_from_peers(self, h: Host) -> None:
        """Partition ``h`` from the other hosts but not from the bridge (etcd): a silent drop
        of its traffic to and from the hosts' subnet, except the bridge's own addresses
        (an htb qdisc whose u32 filters send that traffic to a ``pfifo limit 0`` class on
        both ends of its veth). Raises :class:`NetnsUnavailable` where the kernel lacks
        them."""
        sub4 = self.bridge_ip4.rsplit(".", 1)[0] + ".0/24"
        sub6 = self.bridge_ip6.rsplit("::", 1)[0] + "::/64"
        inside = ("ip", "netns", "exec", h.netns)
        try:
            self._drop_but_bridge(inside, h.ns_if, "dst", sub4, sub6)
            self._drop_but_bridge((), h.host_if, "src", sub4, sub6)
        except RuntimeError as exc:
            run_cmd(*inside, "tc", "qdisc", "del", "dev", h.ns_if, "root", check=False)
            run_cmd("tc", "qdisc", "del", "dev", h.host_if, "root", check=False)
            raise NetnsUnavailable(f"cutting a host from its peers with tc failed: {exc}") from exc
        h.cut_mode = "peers"

    def _drop_but_bridge(self, where: tuple[str, ...], dev: str, side: str, sub4: str,
                         sub6: str) -> None:
        tc = (*where, "tc")
        run_cmd(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        for cls in ("1:10", "1:20"):
            run_cmd(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
                    "rate", "10gbit")
        run_cmd(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo",
                "limit", "0")
        f = (*tc, "filter", "add", "dev", dev, "parent", "1:")
        run_cmd(*f, "protocol", "ip", "prio", "1", "u32", "match", "ip", side,
                f"{self.bridge_ip4}/32", "flowid", "1:10")
        run_cmd(*f, "protocol", "ip", "prio", "2", "u32", "match", "ip", side, sub4,
                "flowid", "1:20")
        run_cmd(*f, "protocol", "ipv6", "prio", "3", "u32", "match", "ip6", side,
                f"{self.bridge_ip6}/128", "flowid", "1:10")
        run_cmd(*f, "protocol", "ipv6", "prio", "4", "u32", "match", "ip6", side, sub6,
                "flowid", "1:20")

    def cut_from_etcd(self, h: Host) -> None:
        """Partition ``h`` from the bridge's own addresses (where etcd listens) but not from
        the other hosts: a silent drop of its traffic to and from those addresses only (an
        htb qdisc whose u32 filters send it to a ``pfifo limit 0`` class on both ends of its
        veth). Raises :class:`NetnsUnavailable` where the kernel lacks them."""
        inside = ("ip", "netns", "exec", h.netns)
        try:
            self._drop_bridge(inside, h.ns_if, "dst")
            self._drop_bridge((), h.host_if, "src")
        except RuntimeError as exc:
            run_cmd(*inside, "tc", "qdisc", "del", "dev", h.ns_if, "root", check=False)
            run_cmd("tc", "qdisc", "del", "dev", h.host_if, "root", check=False)
            raise NetnsUnavailable(f"cutting a host from etcd with tc failed: {exc}") from exc
        h.cut_mode = "etcd"

    def _drop_bridge(self, where: tuple[str, ...], dev: str, side: str) -> None:
        tc = (*where, "tc")
        run_cmd(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        for cls in ("1:10", "1:20"):
            run_cmd(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
                    "rate", "10gbit")
        run_cmd(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo",
                "limit", "0")
        f = (*tc, "filter", "add", "dev", dev, "parent", "1:")
        if self.ipv4:
            run_cmd(*f, "protocol", "ip", "prio", "1", "u32", "match", "ip", side,
                    f"{self.bridge_ip4}/32", "flowid", "1:20")
        if self.ipv6:
            run_cmd(*f, "protocol", "ipv6", "prio", "2", "u32", "match", "ip6", side,
                    f"{self.bridge_ip6}/128", "flowid", "1:20")

    def heal(self, h: Host) -> None:
        if h.cut_mode in ("drop", "peers", "etcd"):
            run_cmd("ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", h.ns_if, "root")
            run_cmd("tc", "qdisc", "del", "dev", h.host_if, "root")
        elif h.cut_mode == "down":
            run_cmd("ip", "link", "set", h.host_if, "up")
        h.cut_mode = ""

    def pids(self, h: Host) -> list[int]:
        r = run_cmd("ip", "netns", "pids", h.netns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs inside, delete namespaces, links, bridge. Idempotent, never raises."""
        for h in self.hosts:
            if f"ns:{h.netns}" not in self._created:
                continue
            kill_all(lambda h=h: self.pids(h))
            run_cmd("ip", "netns", "del", h.netns, check=False)
        for item in self._created:
            if item.startswith("if:"):
                run_cmd("ip", "link", "del", item[3:], check=False)
        if "br" in self._created:
            run_cmd("ip", "link", "del", self.bridge, check=False)
        self._created.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def hosts_or_skip(n: int, what: str, ipv4: bool = True) -> Iterator[Hosts]:
    """``n`` hosts (``Hosts(n, ipv4=ipv4)``) for a pytest test, closed afterwards; the test
    is skipped, saying why, where network namespaces are unavailable (not root, no ``ip``)."""
    import pytest  # here: benchmarks/soak.py uses this module without pytest

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"{what}: {reason}")
    try:
        hs = Hosts(n, ipv4=ipv4).create()
    except NetnsUnavailable as exc:
        pytest.skip(f"{what}: {exc}")
    try:
        yield hs
    finally:
        hs.close()
