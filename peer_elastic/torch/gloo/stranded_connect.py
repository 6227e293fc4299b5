"""Freeing a rank that gloo leaves waiting for a member that died while the group formed.

gloo connects a new group's full mesh pair by pair, in rank order. Of each pair one rank
connects (the initiator) and the other waits for that connection on its device's listener,
for five times the group timeout (torch 2.13's gloo, ``Pair::waitUntilConnected``), inside
C++, with nothing that interrupts it. A member killed after publishing its address leaves
every rank that listens for it waiting that long: 25 s at the 5 s group timeout
:meth:`~peer_elastic.torch.group.GroupManager.init_timeout_s` gives three ranks, however fast
the others learn of the death.

Once the group being formed can never complete (a roster member's lease is gone, it is cut
off from the others, or its probe port refuses connections: its process is gone) a rank
still inside the init ``grace_s`` after it began (among live peers forming takes
milliseconds) is waiting for someone who is not coming, and :class:`FormingGuard` ends
those waits by hand:

* the connections this group opened so far are shut down (an initiator waiting on a host
  that no longer answers fails at once);
* for every other rank, it connects to this rank's own gloo listener and sends the
  sequence number that rank would have sent (gloo's wire protocol: the initiator writes
  the listener's 8-byte sequence number for the pair, nothing else), then closes. gloo hands
  the waiting pair a socket that is already closed: the wait ends and the group fails, or
  forms broken and the caller discards it. Pairs already connected, or not reached yet,
  only get a spare socket that gloo stashes and drops with the group.

A generation merely superseded while its live members form it (a join, a drain, a resize)
is not a reason: every member is alive and connects, the group forms everywhere and is left
at the next check, as design.md's "every member forms the group, or none does" wants. Acting
on supersession instead tore such groups apart on a loaded machine, where an init can last
longer than the grace. Every member's guard sees the same facts (the view, the probe), so
members stranded together leave together.

The sequence numbers and the listener's address come from this rank's own record, which
gloo writes to the store before it connects (:func:`parse_gloo_rank` reads it; values that
do not match its layout exactly are ignored, and then only the first step applies).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from peer_elastic.process import threads
from peer_elastic.process.sockets import socket_inodes
from peer_elastic.torch.gloo.abort import Changes, GroupConnections
from peer_elastic.torch.gloo.gloo_records import GlooRankRecord, parse_gloo_rank

log = logging.getLogger(__name__)

_SIZE = struct.Struct("<Q")  # gloo writes sequence numbers as native 64-bit
#: How often the guard re-checks the generation when no membership change wakes it.
_CHECK_S = 1.0
#: How often a guard that fired repeats its work while the init is still stuck.
_REPEAT_S = 2.0


def release_listening_pairs(record: GlooRankRecord, rank: int, timeout_s: float = 1.0) -> int:
    """Connect to ``rank``'s own listener once per other rank, sending that rank's sequence
    number, and close: every pair of ``rank`` still waiting to be connected gets a closed
    socket. Returns how many connections were made."""
    made = 0
    for peer, seq in enumerate(record.pair_ids):
        if peer == rank:
            continue
        try:
            with socket.create_connection((record.host, record.port), timeout=timeout_s) as s:
                s.sendall(_SIZE.pack(seq))
            made += 1
        except OSError as exc:  # the listener is gone: the group is being torn down
            log.debug("releasing pair %d of rank %d: %s", peer, rank, exc)
    return made


class FormingGuard:
    """While ``init_process_group`` forms a gloo group: once ``doomed()`` gives a reason and
    the init has lasted ``grace_s``, ends the waits that a member gone mid-rendezvous would
    leave (module docstring). While the init lasts past ``grace_s`` and nothing dooms it,
    ``on_stuck()`` is called every few seconds: the caller looks for a member that died
    there, which nobody else may have noticed, and returns why the group is doomed if it
    found one (then the guard acts at once), else None.

    Use as a context manager around the init, after ``__init__``; pass :meth:`saw_value` to
    the group's store so the guard sees this rank's record. ``fired`` holds the reason once
    it acted: the group, if it formed at all, is broken and must be discarded.
    """

    def __init__(self, rank: int, size: int, doomed: Callable[[], str | None],
                 changes: Changes, exclude: Callable[[str, int], bool],
                 grace_s: float = 1.0,
                 on_stuck: Callable[[], str | None] | None = None) -> None:
        self._rank, self._size = rank, size
        self._doomed, self._changes = doomed, changes
        self._exclude = exclude
        self._grace_s, self._on_stuck = grace_s, on_stuck
        self._record: GlooRankRecord | None = None
        self._before: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    def saw_value(self, key: str, value: bytes) -> None:
        """The store's write hook: keeps this rank's gloo record when it is written."""
        if self._record is None:
            record = parse_gloo_rank(value, self._size)
            if record is not None and key.endswith(f"/{self._rank}"):
                self._record = record

    def __enter__(self) -> FormingGuard:
        self._before = socket_inodes()
        self._thread = threads.start(self._watch, "forming-guard")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._changes.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        started = time.monotonic()
        next_stuck_call = started + self._grace_s
        version = -1
        while not self._stop.is_set():
            reason = self._doomed()
            if reason is None and self._on_stuck is not None \
                    and time.monotonic() >= next_stuck_call:
                # Past the grace and not doomed: nobody may know yet that a member died
                # here (it had acknowledged the generation, so no ack is missing).
                next_stuck_call = time.monotonic() + _REPEAT_S
                try:
                    reason = self._on_stuck()
                except Exception:  # a bug there must not end the guarding
                    log.exception("looking for members gone mid-rendezvous failed")
            if reason is None:
                wait_s = _CHECK_S
                if self._on_stuck is not None:
                    wait_s = min(wait_s, next_stuck_call - time.monotonic())
                version = self._changes.wait_change(version, max(0.0, wait_s), self._stop.is_set)
                continue
            left = started + self._grace_s - time.monotonic()
            if left > 0:  # live members finish forming within it: let them
                self._stop.wait(left)
                continue
            self.fired = reason
            self._release(reason)
            self._stop.wait(_REPEAT_S)  # still inside the init: do it again

    def _release(self, reason: str) -> None:
        opened = GroupConnections.opened_since(self._before, self._exclude)
        cut = opened.cut()
        made = (release_listening_pairs(self._record, self._rank)
                if self._record is not None else 0)
        log.info("the group being formed will never be used (%s): shut down %d of its "
                 "connections, released %d waits for peers", reason, cut, made)
