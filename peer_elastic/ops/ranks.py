"""Which rank each peer that ``peer-elastic run`` started holds now, read from etcd.

The launcher knows its peers' process ids; every member record carries the pid and host
of the process that registered it, and the generation record lists members in rank order.
So a peer's current rank is a lookup in the job's watched picture (the same
:class:`~peer_elastic.etcd.view.JobView` the peers use), typed records only, with no
parsing of the peers' output. The command must be the peer process itself (``python
train.py``, or a wrapper that replaces itself with it by ``exec``) for its pid to match.

A role is as current as the launcher's watch, which can be a moment behind the peer (the
peer acts on the generation as soon as its own watch shows it): lines a peer writes just
after joining, or just after a reset, may be labelled by the picture before. Waiting for a
fresh picture before each such line would make the peers' output, and so the peers, wait
on etcd; ``peer-elastic run``'s documentation says what a label promises instead.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.view import JobView, ViewSnapshot
from peer_elastic.ops.multiplex import unknown_role


@dataclass(frozen=True)
class PeerRole:
    """What a peer is in the job now. ``rank`` None: a standby (registered, not in the
    roster); ``member_id`` "": not registered (yet, or any more)."""

    member_id: str = ""
    rank: int | None = None

    def prefix(self, index: int) -> str:
        if not self.member_id:
            return unknown_role(index)
        if self.rank is None:
            return f"[peer{index} standby]: "
        return f"[peer{index} rank{self.rank}]: "


def roles(snap: ViewSnapshot, host: str, pids: Mapping[int, int]) -> dict[int, PeerRole]:
    """The role of each peer in ``pids`` (index -> pid) on ``host`` in ``snap``."""
    roster = list(snap.generation.roster) if snap.generation is not None else []
    by_pid = {m.record.pid: m for m in snap.members.values() if m.host == host}
    out: dict[int, PeerRole] = {}
    for index, pid in pids.items():
        m = by_pid.get(pid)
        if m is None:
            out[index] = PeerRole()
        else:
            out[index] = PeerRole(m.id, roster.index(m.id) if m.id in roster else None)
    return out


class RankTracker:
    """Keeps :func:`roles` of the launcher's peers current from a watch of the job."""

    def __init__(self, client: EtcdClient, job: str, host: str) -> None:
        self.client = client
        self._view = JobView(client, job)
        self._host = host
        self._pids: dict[int, int] = {}
        self._lock = threading.Lock()
        self._cached: tuple[int, int, dict[int, PeerRole]] = (-1, -1, {})

    def start(self) -> RankTracker:
        self._view.start()
        return self

    def stop(self) -> None:
        self._view.stop()

    def add(self, index: int, pid: int) -> None:
        with self._lock:
            self._pids[index] = pid

    def role(self, index: int) -> PeerRole:
        """Peer ``index``'s role as of the latest picture (recomputed once per change)."""
        snap = self._view.snapshot()
        with self._lock:
            version, count, table = self._cached
            if version != snap.version or count != len(self._pids):
                table = roles(snap, self._host, self._pids)
                self._cached = (snap.version, len(self._pids), table)
        return table.get(index, PeerRole())

    def label(self, index: int) -> str:
        return self.role(index).prefix(index)

    def wait_for_role(self, index: int, want: PeerRole, timeout: float) -> bool:
        """Wait (bounded) until peer ``index`` has role ``want`` (for tests and tools)."""
        return self._view.wait_for(lambda _snap: self.role(index) == want, timeout) is not None
