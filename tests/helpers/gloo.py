"""Pieces for tests of gloo's records (tests/test_gloo_records.py,
tests/test_stranded_connect.py): a store that reports what passes through it, as
``EtcdStore(on_value=...)`` does, and a rank record built by hand."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


class ReportingStore(dist.Store):
    """Wraps ``inner``; ``saw(key, value)`` is told of each set and get."""

    def __init__(self, inner: dist.Store, saw: Callable[[str, bytes], None]) -> None:
        super().__init__()
        self.inner, self.saw = inner, saw

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data)
        self.saw(key, data)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self.saw(key, value)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)


def record_bytes(host: str, port: int, pair_ids: list[int], name: bytes = b"h1") -> bytes:
    """A gloo tcp rank record (``Rank::bytes``) for an IPv4 listener."""
    storage = bytearray(128)
    storage[0:2] = socket.AF_INET.to_bytes(2, "little")
    storage[2:4] = port.to_bytes(2, "big")
    storage[4:8] = socket.inet_aton(host)
    address = bytes(storage) + struct.pack("<q", -1)
    return (struct.pack("<Q", len(name)) + name + struct.pack("<Q", len(address)) + address
            + struct.pack(f"<{len(pair_ids)}q", *pair_ids))
