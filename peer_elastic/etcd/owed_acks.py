"""Which acks of the newest generation one registration still owes: :class:`OwedAcks`.

A member acknowledges each generation that lists it as soon as it sees it (``ready``: proof
of life, so a peer busy in a long step is not taken for dead), and once more when that
generation broke (``alive``: the leader drops whoever stays silent after a break). Each is
written once per registration; one that etcd did not take is owed again at the next look.
Nothing here touches etcd.
"""

from __future__ import annotations

from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.etcd.writer import AckKind

__all__ = ["OwedAcks"]


class OwedAcks:
    """The acks one registration gave, and so those it still owes; see the module docstring."""

    def __init__(self) -> None:
        self._given: dict[AckKind, set[int]] = {AckKind.READY: set(), AckKind.ALIVE: set()}

    def owed(self, snap: ViewSnapshot, member_id: str) -> list[AckKind]:
        """The acks of ``snap``'s generation ``member_id`` owes now, in the order to write
        them (the caller says :meth:`given` for each one etcd took)."""
        gen = snap.generation
        if gen is None:
            return []
        for given in self._given.values():  # only the generations n and n-1 matter
            given &= {gen.number - 1, gen.number}
        if member_id not in snap.roster_ids():
            return []
        owed = []
        if gen.number not in self._given[AckKind.READY]:
            owed.append(AckKind.READY)
        if snap.broken.get(gen.number) and gen.number not in self._given[AckKind.ALIVE]:
            owed.append(AckKind.ALIVE)  # proof of life after the break
        return owed

    def given(self, kind: AckKind, generation: int) -> None:
        self._given[kind].add(generation)

    def forget(self) -> None:
        """A new registration: it owes every ack again."""
        for given in self._given.values():
            given.clear()
