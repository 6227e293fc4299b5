"""Which network address a peer's process groups use, and whether the others reach it.

gloo, left alone, resolves the machine's hostname and binds to the result. On Debian and
Ubuntu images ``/etc/hosts`` maps the hostname to 127.0.1.1, so every peer of a multi-host job
advertises a loopback address and no group ever forms. :func:`select_address` decides
instead, before the first group, in this order:

1. ``PEER_ELASTIC_ADDR``: this address (it must be one of this machine's); its interface.
2. ``PEER_ELASTIC_IFNAME``: this interface.
3. ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` set by the user: left as they are.
4. Otherwise the interface and address that route to the etcd endpoints: the local address
   of a TCP connection to the first endpoint that accepts one (a routing lookup if none
   does). A loopback address keeps the single-host behaviour: nothing is changed.

In cases 1, 2 and 4 (non-loopback) the interface is handed to gloo (and nccl) through
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` in this process's environment: torch 2.13's
``init_process_group`` builds its gloo device from that variable or the hostname only (it
ignores ``pg_options`` for gloo). gloo then binds to the interface's first address, which is
what the peer advertises (:attr:`NetChoice.address`, the member record's ``net_address``).

:class:`~peer_elastic.process.probe_listener.ProbeListener` accepts TCP connections on that
address, so that before a group is formed every peer can check that it reaches every other
(:func:`probe`): an unreachable peer is named with its address and the fix, instead of a
gloo timeout later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peer_elastic.errors import ConfigError
from peer_elastic.settings_table import NET_ADDR, NET_IFNAME

log = logging.getLogger(__name__)

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
FIX = ("set PEER_ELASTIC_ADDR to an address of that host that the other hosts reach, or "
       "PEER_ELASTIC_IFNAME to its interface (docs/operations.md, multi-host)")


@dataclass(frozen=True)
class NetChoice:
    """What :func:`select_address` decided."""

    address: str  # the IP this peer's groups use and advertise ("" if unknown)
    ifname: str | None  # the interface handed to gloo, None when left to gloo/the user
    how: str  # for the log: which rule decided


# -- this machine's interfaces (getifaddrs, in its order: the order gloo reads them in) --------


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)), ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IP) for every IPv4/IPv6 address of this machine, in getifaddrs order."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out = []
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.ifa_addr:
                fam = ifa.ifa_addr.contents.sa_family
                raw = ctypes.string_at(ifa.ifa_addr, 28)
                if fam == socket.AF_INET:
                    out.append((ifa.ifa_name.decode(), socket.inet_ntop(fam, raw[4:8])))
                elif fam == socket.AF_INET6:
                    out.append((ifa.ifa_name.decode(), socket.inet_ntop(fam, raw[8:24])))
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def interface_of(address: str, addrs: Sequence[tuple[str, str]] | None = None) -> str | None:
    """The interface that holds ``address``, or None."""
    want = ipaddress.ip_address(address)
    for name, ip in addrs if addrs is not None else interface_addresses():
        if ipaddress.ip_address(ip) == want:
            return name
    return None


def gloo_address(ifname: str, addrs: Sequence[tuple[str, str]] | None = None) -> str | None:
    """The address gloo binds to for ``ifname``: its first IPv4 or IPv6 address."""
    for name, ip in addrs if addrs is not None else interface_addresses():
        if name == ifname:
            return ip
    return None


def route_source(endpoints: Iterable[tuple[str, int]], timeout: float = 1.0) -> str | None:
    """The local address of a connection to the first endpoint that accepts one; if none
    does, the source address the routing table picks for the first that resolves."""
    resolved: list[tuple[int, tuple]] = []
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        resolved += [(fam, sa) for fam, _, _, _, sa in infos]
    for fam, sa in resolved:
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(sa)
                return str(s.getsockname()[0])
        except OSError:
            continue
    for fam, sa in resolved:
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect(sa)  # no packet: only the route lookup
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def select_address(endpoints: Iterable[tuple[str, int]], *, apply: bool = True,
                   environ: dict[str, str] | None = None) -> NetChoice:
    """Decide this peer's group address (module docstring); with ``apply``, hand the
    interface to gloo and nccl through ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    addrs = interface_addresses()
    names = sorted({n for n, _ in addrs})
    forced_addr = NET_ADDR.raw()
    forced_if = NET_IFNAME.raw()
    if forced_addr:
        try:
            address = str(ipaddress.ip_address(forced_addr.strip("[]")))
        except ValueError:
            raise ConfigError(f"{NET_ADDR.env}={forced_addr!r} is not an IP address") from None
        ifname = forced_if or interface_of(address, addrs)
        if ifname is None:
            raise ConfigError(
                f"{NET_ADDR.env}={address} is not an address of this machine (its addresses: "
                + ", ".join(f"{n} {ip}" for n, ip in addrs) + ")")
        choice = NetChoice(address, ifname, f"{NET_ADDR.env}")
    elif forced_if:
        address = gloo_address(forced_if, addrs)
        if address is None:
            raise ConfigError(f"{NET_IFNAME.env}={forced_if!r}: no such interface with an "
                              f"address on this machine (its interfaces: {', '.join(names)})")
        choice = NetChoice(address, forced_if, f"{NET_IFNAME.env}")
    elif env.get(GLOO_IFNAME) or env.get(NCCL_IFNAME):
        # The user's choice, untouched; advertise the address gloo will use if we know it.
        first = (env.get(GLOO_IFNAME) or env.get(NCCL_IFNAME) or "").split(",")[0]
        address = gloo_address(first, addrs) or route_source(endpoints) or ""
        return NetChoice(address, None, GLOO_IFNAME if env.get(GLOO_IFNAME) else NCCL_IFNAME)
    else:
        address = route_source(endpoints) or ""
        if not address or is_loopback(address):
            # Single host (etcd on loopback): gloo's own choice works, keep it.
            return NetChoice(address or "127.0.0.1", None, "etcd is on loopback")
        ifname = interface_of(address, addrs)
        if ifname is None:
            log.warning("the address %s that routes to etcd is on no interface; leaving the "
                        "choice to gloo", address)
            return NetChoice(address, None, "route to etcd")
        # gloo binds to the interface's first address, which may be of the other family.
        choice = NetChoice(gloo_address(ifname, addrs) or address, ifname, "route to etcd")
    if apply and choice.ifname:
        env[GLOO_IFNAME] = choice.ifname
        env.setdefault(NCCL_IFNAME, choice.ifname)
    return choice


# -- reachability --------------------------------------------------------------------------------


def plain_ip(address: str) -> str:
    """``address`` without brackets, a zone or an IPv4-mapped prefix (``::ffff:10.0.0.2``
    is how a dual-stack socket shows an IPv4 peer), to compare addresses as written."""
    ip = address.strip("[]").split("%", 1)[0]
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def probe(address: str, port: int, timeout: float = 2.0, attempts: int = 2) -> str | None:
    """None if a TCP connection to ``address:port`` succeeds, else why not."""
    why = ""
    for _ in range(max(1, attempts)):
        try:
            socket.create_connection((address, port), timeout=timeout).close()
            return None
        except TimeoutError:
            why = f"no answer within {timeout:g} s"
        except OSError as exc:
            why = exc.strerror or str(exc)
    return why
