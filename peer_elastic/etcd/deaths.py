"""Confirming a member's death faster than ``join_timeout_s``: a refused probe connection.

Every peer started by ``pe.join()`` listens on its group address (``ProbeListener`` in
:mod:`peer_elastic.process.probe_listener`) and publishes the port in its member record. When a process
dies its kernel closes that listening socket, and a TCP connection to it is *refused* (a
reset, at once). That is proof the process is gone; nothing else is:

* a stopped (SIGSTOP) or hung process still completes the handshake (the kernel accepts
  into the backlog): a successful connect, not proof of anything;
* a partitioned or powered-off host does not answer, or is unreachable: no proof either;
* another process that reused the port accepts: again a success, so reuse can only make us
  slower, never wrong.

So only ``ECONNREFUSED`` confirms a death; every other case keeps the ``join_timeout_s``
path (:func:`~peer_elastic.etcd.roster.silent_members`). Members without a probe port
(simulated members, old writers) are never probed, nor is a loopback address unless the
prober's own is one too (a single-host job): a refusal from *my* loopback says nothing
about a peer on another host that advertises one by mistake. (An operator's firewall rule that
*rejects* connections to the probe port with a reset would look like a death; drop, not
reject, if a rule must sit between peers.)

Who probes whom (so hundreds of members do not all probe everyone): a member probes only
what decides whether it is the writer, and the writer probes the rest.

* Walking from the member just older than me towards the oldest: a member that has its ack
  means it (or someone older) writes, not me: stop. A member missing its ack is probed; I go
  on past it only once it is confirmed dead. With one dead leader only the next-oldest
  probes it; everyone else stops at their live elder.
* Reaching the oldest that way means I write: I probe every member missing its ack.

:class:`DeathProber` runs the probes on its own thread, every :data:`PROBE_INTERVAL_S`
while targets stay missing, and keeps the confirmed deaths (:class:`Death`) for the leader
(:meth:`~peer_elastic.etcd.leader.Leader.step`). Nothing here imports torch.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from peer_elastic.etcd.view import Member, ViewSnapshot
from peer_elastic.process import threads
from peer_elastic.process.netaddr import host_port, is_loopback

log = logging.getLogger(__name__)

#: How often a member still missing its ack is probed again.
PROBE_INTERVAL_S = 0.05
#: A probe's connect timeout: only a refusal counts, so a slow answer is simply no proof.
PROBE_TIMEOUT_S = 0.25
#: Probes at once (a writer facing many missing members); the rest wait a round.
MAX_PROBES_PER_ROUND = 64
_WORKERS = 8


@dataclass(frozen=True)
class Death:
    """A member whose process is confirmed gone, and the evidence."""

    member_id: str
    endpoint: str  # host:port that refused
    why: str  # e.g. "connection refused"
    at: float  # monotonic time of the refusal

    def describe(self) -> str:
        return f"process gone: {self.why} at {self.endpoint}"


@dataclass(frozen=True)
class ProbeTarget:
    member_id: str
    address: str
    port: int


def missing_acks(snap: ViewSnapshot) -> list[str]:
    """Roster members of the current generation that owe an ack, roster order: ``ready``
    for the generation, or (once it broke) ``alive``; a member that marked it broken has
    answered. Only members with a live key count (the rest are gone already)."""
    gen = snap.generation
    if gen is None:
        return []
    owing = snap.owing_acks()
    return [m for m in gen.roster if m in owing]


def probe_targets(snap: ViewSnapshot, me: str, dead: Mapping[str, Death]) -> list[ProbeTarget]:
    """What ``me`` should probe now (module docstring): the missing elders that stand
    between it and writing, or, if none does, every missing member. Excludes the confirmed
    dead and members without a probe port.

    Every member asks on every change it sees: this reads the snapshot's shared answers
    (:meth:`ViewSnapshot.owing_acks`, :meth:`ViewSnapshot.eligible_rank`) and walks only
    from ``me`` to its first live elder, so it costs a follower O(1), not O(members).
    """
    missing = snap.owing_acks()
    if not missing:
        return []
    rank = snap.eligible_rank(me)
    if rank is None:
        return []
    eligible = snap.eligible_members()
    chosen: list[Member] = []
    writer = True
    for k in range(rank - 1, -1, -1):
        m = eligible[k]
        if m.id not in missing:
            writer = False  # a live elder writes
            break
        if m.id not in dead:
            chosen.append(m)
            writer = False  # until it is confirmed dead
            break
    if writer:
        chosen = [snap.members[m] for m in sorted(missing, key=_age(snap)) if m not in dead]
    return probeable(snap, me, chosen)


def probeable(snap: ViewSnapshot, me: str, members: Iterable[Member]) -> list[ProbeTarget]:
    """Of ``members``, those ``me`` may probe (module docstring): with a group address and
    a probe port, not ``me``, and on loopback only when ``me`` is on loopback too."""
    mine = snap.members.get(me)
    local = mine is not None and is_loopback(mine.record.net_address)
    return [ProbeTarget(m.id, m.record.net_address, m.record.probe_port) for m in members
            if m.record.net_address and m.record.probe_port and m.id != me
            and (local or not is_loopback(m.record.net_address))]


def _age(snap: ViewSnapshot) -> Callable[[str], int]:
    return lambda m: snap.members[m].create_revision


def refused(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """``"connection refused"`` if a TCP connection to ``address:port`` is refused, else
    None (accepted, timed out, unreachable: no proof of death)."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "connection refused"
    except OSError:
        return None
    return None


def refusing(targets: Sequence[ProbeTarget],
             probe: Callable[[str, int], str | None] = refused,
             ) -> list[tuple[ProbeTarget, str]]:
    """Probe ``targets`` now, side by side: those that refused, with why."""
    if len(targets) <= 1:
        whys = [probe(t.address, t.port) for t in targets]
    else:
        with ThreadPoolExecutor(min(_WORKERS, len(targets))) as pool:
            whys = list(pool.map(lambda t: probe(t.address, t.port), targets))
    return [(t, why) for t, why in zip(targets, whys, strict=True) if why is not None]


def all_gone(targets: Iterable[ProbeTarget], member_ids: Collection[str],
             probe: Callable[[str, int], str | None] = refused) -> list[Death] | None:
    """Probe ``member_ids`` now, each at its target among ``targets``: their deaths if every
    one refused, else None (one has no target, or it accepted, timed out or is unreachable:
    no proof). For a caller that holds the targets of members already gone from the view
    (a group's roster, remembered when it formed)."""
    by_id = {t.member_id: t for t in targets}
    if not member_ids or any(m not in by_id for m in member_ids):
        return None
    dead = refusing([by_id[m] for m in member_ids], probe)
    if len(dead) < len(member_ids):
        return None
    now = time.monotonic()
    return [Death(t.member_id, host_port(t.address, t.port), why, now) for t, why in dead]


class DeathProber:
    """Probes the current targets on a background thread; keeps the confirmed deaths.

    :meth:`update` (the coordination thread, each view change) sets the targets;
    ``on_confirmed`` is called (from the probe thread) after a new death is recorded, so the
    coordination thread looks again at once. :attr:`version` counts confirmed deaths.

    The thread starts with the first target, so members that never probe (simulated
    members, which have no probe port: a thousand in one process) cost no thread.
    """

    def __init__(self, on_confirmed: Callable[[], None],
                 probe: Callable[[str, int], str | None] = refused,
                 interval_s: float = PROBE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_confirmed = on_confirmed
        self._probe = probe
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Condition()
        self._targets: tuple[ProbeTarget, ...] = ()
        self._dead: dict[str, Death] = {}
        self._stop = False
        self.version = 0
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def started(self) -> bool:
        """Whether the probe thread runs (it starts with the first target)."""
        return self._thread is not None

    def _start_thread(self) -> None:  # under self._lock
        if self._thread is None and not self._stop:
            self._thread = threads.start(self._loop, "peer-elastic-deaths")

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def confirmed(self) -> dict[str, Death]:
        with self._lock:
            return dict(self._dead)

    def update(self, snap: ViewSnapshot, me: str) -> None:
        """Aim the probes at what ``snap`` asks of member ``me``; forget deaths of members
        that left the view."""
        with self._lock:
            for m in [m for m in self._dead if m not in snap.members]:
                del self._dead[m]
            targets = tuple(probe_targets(snap, me, self._dead))
            if targets != self._targets:
                self._targets = targets
                if targets:
                    self._start_thread()
                self._lock.notify_all()

    def probe_once(self) -> int:
        """One round over the current targets; returns how many deaths it confirmed."""
        with self._lock:
            targets = self._targets[:MAX_PROBES_PER_ROUND]
        if not targets:
            return 0
        if len(targets) == 1:
            whys = [self._probe(targets[0].address, targets[0].port)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="peer-elastic-probe")
            whys = list(self._pool.map(lambda t: self._probe(t.address, t.port), targets))
        now = self._clock()
        found = 0
        with self._lock:
            for t, why in zip(targets, whys, strict=True):
                if why is None or t.member_id in self._dead:
                    continue
                endpoint = host_port(t.address, t.port)
                self._dead[t.member_id] = Death(t.member_id, endpoint, why, now)
                log.warning("member %s confirmed dead: %s at %s", t.member_id, why, endpoint)
                found += 1
            if found:
                self.version += 1
                self._targets = tuple(t for t in self._targets if t.member_id not in self._dead)
        if found:
            self._on_confirmed()
        return found

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or bool(self._targets))
                if self._stop:
                    return
            try:
                self.probe_once()
            except Exception:  # never let a probe kill the thread; the timeout path remains
                log.exception("death probe failed")
            with self._lock:
                self._lock.wait_for(lambda: self._stop, timeout=self._interval_s)

