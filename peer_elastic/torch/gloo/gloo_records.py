"""gloo's tcp rank records, as gloo writes them to the group's store, and the listeners
they name.

Before it connects a group's full mesh, each rank of a gloo group writes one record to the
store: its hostname, its device listener's address and one pair sequence number per rank
(gloo ``transport/tcp/context.cc``, ``Rank::bytes``); the other ranks read it to connect.
Two parts use them: the formation guard (:mod:`peer_elastic.torch.gloo.stranded_connect`) reads
this rank's own record, and :class:`GlooListeners` collects every record a generation's
store carries, subgroups' included, so that the connections of groups made at any time in
the generation can be told apart from everything else (:meth:`GroupConnections.touching
<peer_elastic.torch.gloo.abort.GroupConnections.touching>`).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from peer_elastic.process.netaddr import plain_ip

__all__ = ["GlooListeners", "GlooRankRecord", "parse_gloo_rank"]

_SIZE = struct.Struct("<Q")  # gloo writes sizes and sequence numbers as native 64-bit
_SOCKADDR_STORAGE = 128  # sizeof(struct sockaddr_storage) on Linux


@dataclass(frozen=True)
class GlooRankRecord:
    """What one rank of a forming gloo group published: where its listener is and the
    sequence number each peer must send it to connect their pair."""

    hostname: str
    family: int  # socket.AF_INET or AF_INET6
    host: str
    port: int
    pair_ids: tuple[int, ...]  # by peer rank


def parse_gloo_rank(value: bytes, size: int | None = None) -> GlooRankRecord | None:
    """``value`` as gloo's tcp rank record of a group of ``size`` ranks (of any size when
    None: a subgroup's), else None.

    The layout (gloo ``transport/tcp/context.cc``, ``Rank::bytes``): the hostname's length
    and bytes, the device address' length and bytes (a ``sockaddr_storage`` and a sequence
    number), then one 64-bit pair identifier per rank. Every length must add up exactly.
    """
    try:
        (name_len,) = _SIZE.unpack_from(value, 0)
        at = _SIZE.size + name_len
        (addr_len,) = _SIZE.unpack_from(value, at)
        addr = value[at + _SIZE.size:at + _SIZE.size + addr_len]
        at += _SIZE.size + addr_len
    except struct.error:
        return None
    ids = len(value) - at
    if size is None:
        size = ids // 8 if ids > 0 and ids % 8 == 0 else -1
    if (addr_len != _SOCKADDR_STORAGE + _SIZE.size or len(addr) != addr_len
            or size <= 0 or ids != 8 * size):
        return None
    family = int.from_bytes(addr[0:2], "little")
    (port,) = struct.unpack_from(">H", addr, 2)
    if family == socket.AF_INET:
        host = socket.inet_ntop(socket.AF_INET, addr[4:8])
    elif family == socket.AF_INET6:
        host = socket.inet_ntop(socket.AF_INET6, addr[8:24])
    else:
        return None
    pair_ids = struct.unpack_from(f"<{size}q", value, at)
    if port == 0 or any(i < 0 for i in pair_ids):
        return None
    return GlooRankRecord(value[8:8 + name_len].decode("utf-8", "replace"), family, host,
                          port, pair_ids)


class GlooListeners:
    """The gloo listeners (plain ip, port) named by the records seen in one generation's
    store: pass :meth:`saw_value` to the store as its hook for values written and read.
    Thread-safe: the store calls it from whichever thread makes a group. ``on_change`` gets
    every address seen so far each time one is added (under this object's lock, so that
    the calls come in order)."""

    def __init__(self, on_change: Callable[[frozenset[tuple[str, int]]], None] | None = None,
                 ) -> None:
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._on_change = on_change

    def saw_value(self, key: str, value: bytes) -> None:
        record = parse_gloo_rank(value)
        if record is not None:
            address = (plain_ip(record.host), record.port)
            with self._lock:
                if address in self._seen:
                    return
                self._seen.add(address)
                if self._on_change is not None:
                    self._on_change(frozenset(self._seen))

    def addresses(self) -> frozenset[tuple[str, int]]:
        with self._lock:
            return frozenset(self._seen)
