"""The commit point of a rendezvous: every member goes on to form the group, or none does.

Forming a process group, every rank publishes its address in the store and then reads the
others' and connects to them. A rank that gave up in the middle (its generation was
superseded) used to leave after publishing; a rank that had read that address went on
connecting to it inside gloo, where nothing interrupts it: measured on torch 2.13, five
times the group timeout (150 s at the default 30 s), or a group formed without it whose
first collective failed.

So before the rendezvous each member passes this barrier over an :class:`EtcdStore`: it
*arrives* (one key per member) and waits until every member's key exists at one revision.
Then the barrier has *committed*: every member goes on to form the group, and nobody gives
up on it merely because a newer generation exists (it forms, and the next check leaves it).
A member that wants to give up first *withdraws*: in one transaction its key is deleted
unless every other key exists, in which case the barrier committed after all and it goes
on too. Keys go only by withdrawal, and a withdrawal needs another key missing: so once one
revision holds every key, every later withdrawal fails, and a member that withdrew for good
keeps every later revision from holding every key. Either every member sees the commit, or
none does (a member that withdrew and arrives again simply waits like the others).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from peer_elastic.torch.store import EtcdStore, StoreAborted, StoreTimeout


class Arrival(enum.Enum):
    """How a member left the barrier."""

    COMMITTED = "committed"  # every member arrived: form the group
    ABANDONED = "abandoned"  # withdrawn: the store's abort() gave a reason
    TIMED_OUT = "timed_out"  # withdrawn: not every member arrived in time


@dataclass(frozen=True)
class BarrierResult:
    arrival: Arrival
    detail: str = ""  # why it withdrew, for logs


def pass_barrier(store: EtcdStore, me: str, members: Sequence[str],
                 timeout: timedelta) -> BarrierResult:
    """Arrive as ``me`` and wait for the other ``members`` (see the module docstring).

    ``store`` holds this barrier's keys only; its ``abort()`` says when to give up waiting.
    """
    others = [m for m in members if m != me]
    store.set(me, b"")
    try:
        store.wait(others, timeout)
        return BarrierResult(Arrival.COMMITTED)
    except StoreAborted:
        arrival, detail = Arrival.ABANDONED, store.abort_reason or "aborted"
    except StoreTimeout as exc:
        arrival, detail = Arrival.TIMED_OUT, str(exc)
    if not store.delete_unless_all_exist(me, others):
        return BarrierResult(Arrival.COMMITTED)  # everyone arrived before the withdrawal
    return BarrierResult(arrival, detail)
