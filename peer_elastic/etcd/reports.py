"""What the training side reports into the run through this member's registration, best
effort: :class:`MemberReports`.

A broken generation, members its process groups cannot reach, the commits of the training
state. Each is worth writing and never worth dying for: when there is no registration (none
yet, or its lease was lost) or etcd does not take it, the report is logged and the call
returns False. The others learn the same another way (their own marks, missing acks, the
next commit's record), and a lost lease is handled by rejoining. Nothing here imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from peer_elastic.errors import EtcdError
from peer_elastic.etcd.writer import AckKind, RunWriter

__all__ = ["MemberReports"]

log = logging.getLogger(__name__)


class MemberReports:
    """Best-effort reports of one member; see the module docstring.

    ``current()`` gives the current registration's writer and member lease id, read
    together (None for either: no registration now).
    """

    def __init__(self, current: Callable[[], tuple[RunWriter | None, int | None]]) -> None:
        self._current = current

    def mark_broken(self, generation: int, detail: str = "") -> bool:
        """Say that a collective of ``generation`` failed, so the leader proposes the next now.

        The caller is on its way to re-form either way: the leader also learns of the
        failure from the other ranks' marks, or at worst from the missing acks of the peer
        that failed.
        """
        return self._write(
            f"mark generation {generation} broken",
            lambda w, lease: w.ack(AckKind.BROKEN, generation, lease, detail[:500]))

    def report_unreachable(self, members: Collection[str], generation: int) -> bool:
        """Record that this member's process groups cannot reach ``members``
        (:mod:`~peer_elastic.etcd.reach`)."""
        return self._write(
            f"report unreachable members {sorted(members)}",
            lambda w, lease: w.report_unreachable(members, generation, lease))

    def clear_unreachable(self) -> bool:
        """Withdraw this member's report: everyone it named answers again."""
        return self._write("withdraw the report of unreachable members",
                           lambda w, _lease: w.clear_unreachable())

    def record_state(self, commits: int, generation: int) -> bool:
        """Say that the run's training state has ``commits`` commits (a group that forms
        with no holder of the state reads it); the next commit's mark says it again."""
        return self._write("record the state's commits",
                           lambda w, _lease: w.state(commits, generation))

    def _write(self, what: str, write: Callable[[RunWriter, int], object]) -> bool:
        writer, lease_id = self._current()
        if writer is None or lease_id is None:
            log.info("could not %s: this peer has no registration now", what)
            return False
        try:
            write(writer, lease_id)
        except EtcdError as exc:
            log.warning("could not %s: %s", what, exc)
            return False
        return True
