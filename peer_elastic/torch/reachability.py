"""Whether this peer can reach its roster's advertised group addresses, and what it does
when it cannot.

Every member advertises the address its process groups use and listens there
(``peer_elastic.process.probe_listener``). :class:`Reachability` probes those addresses for
:class:`~peer_elastic.torch.group.GroupManager` at three moments:

* before a rendezvous (:meth:`~Reachability.wait_reachable`): members this peer cannot
  reach are named at once, not at gloo's timeout;
* while a group has been forming for longer than a join timeout
  (:meth:`~Reachability.why_forming_is_stuck`): a member that died there is found;
* while a collective waits (:meth:`~Reachability.waited_on_peers`, told by the hang
  monitor): a member that died while something else holds its connections open, or one cut
  off from the others but not from etcd.

Only a refused connection proves a death (:mod:`peer_elastic.etcd.deaths`); members that do
not answer at all are reported unreachable (:mod:`peer_elastic.etcd.reach`), and the
leader leaves the smaller side of a cut out. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from peer_elastic.errors import ConfigError, PeerElasticError
from peer_elastic.etcd.coordinator import Assignment
from peer_elastic.etcd.deaths import ProbeTarget, probeable, refusing
from peer_elastic.etcd.reach import ReachReporter
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.process import threads
from peer_elastic.process.netaddr import FIX, host_port, is_loopback, probe
from peer_elastic.torch.formed_group import FormedGroup

__all__ = ["ReachCoordinator", "Reachability"]

log = logging.getLogger(__name__)

#: A collective that has waited this long makes the rank probe its group's members for a
#: death (a refused probe), and once it has waited two join timeouts (if longer) for their
#: reachability too; then again every _STALL_PROBE_EVERY_S while it waits.
_STALL_PROBE_AFTER_S = 2.0
_STALL_PROBE_EVERY_S = 5.0


def _where(targets: Iterable[ProbeTarget]) -> str:
    """``member at host:port, ...`` for log lines and broken-generation details."""
    return ", ".join(f"{t.member_id} at {host_port(t.address, t.port)}" for t in targets)


class ReachCoordinator(Protocol):
    """What :class:`Reachability` uses of the coordinator."""

    member_id: str
    host: str

    def snapshot(self) -> ViewSnapshot: ...

    def check(self, snap: ViewSnapshot | None = None) -> None:
        """Raise whatever ends this peer's participation (done, a drain, a fatal error)."""
        ...

    def mark_broken(self, generation: int, detail: str = "") -> bool: ...

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None,
                     timings: Mapping[str, float] | None = None) -> None: ...

    def report_unreachable(self, members: Collection[str], generation: int) -> bool: ...

    def clear_unreachable(self) -> bool: ...


class Reachability:
    """This peer's probes of its roster's group addresses; see the module docstring."""

    def __init__(self, coordinator: ReachCoordinator, collective_timeout_s: float,
                 join_timeout_s: Callable[[], float],
                 current: Callable[[], FormedGroup | None]) -> None:
        self._coord = coordinator
        self._collective_timeout_s = collective_timeout_s
        self._join_timeout_s = join_timeout_s  # how long a member may stay silent
        self._current = current  # the group this peer is in now
        self._reporter = ReachReporter(  # members this peer cannot reach, kept true in etcd
            lambda members, n: coordinator.report_unreachable(members, n),
            lambda: coordinator.clear_unreachable(), self._probe_member)
        self._lock = threading.Lock()
        self._next_stall_probe = 0.0  # time.monotonic(); under _lock
        self._stall_probe: threading.Thread | None = None

    def close(self) -> None:
        self._reporter.close()

    def waited_on_peers(self, waited_s: float) -> None:
        """The training thread has waited on its peers for ``waited_s`` without a break (the
        hang monitor says so about every second while it does).

        Two things end such a wait late or never, and both are looked for on a thread of
        their own once it has lasted 2 s, then every 5 s while it lasts:

        * a member that died while something else holds its connections open (a program it
          started inherited them): nothing fails here, and the leader, which sees every
          ack, has no reason to probe it. A refused probe is proof: the generation is
          marked broken, naming it, so the leader confirms the death and drops it, and
          the hang watchdog abandons the group after a short grace
          (``GroupManager.lost_peer``).
        * a member cut off from the others but not from etcd keeps its lease. Once the wait
          has lasted two join timeouts too, the unreachable members are reported
          (:mod:`peer_elastic.etcd.reach`): the leader leaves the cut-off side out, and the
          hang watchdog abandons the group (cause ``CUT_OFF``).

        A live member answers the probe however slow or stopped it is (its kernel
        accepts), so a straggler costs this only a few connections.
        """
        group = self._current()
        if group is None or group.assignment.size <= 1:
            return
        if waited_s < _STALL_PROBE_AFTER_S:
            return
        reach = waited_s >= 2 * self._join_timeout_s()
        now = time.monotonic()
        with self._lock:
            if now < self._next_stall_probe or (
                    self._stall_probe is not None and self._stall_probe.is_alive()):
                return
            self._next_stall_probe = now + _STALL_PROBE_EVERY_S
            self._stall_probe = threads.start(self._probe_waited_group, "stall-probe",
                                              args=(group, waited_s, reach))

    def _probe_waited_group(self, group: FormedGroup, waited_s: float, reach: bool) -> None:
        n = group.assignment.generation
        try:
            if group is not self._current():
                return
            context = f"a collective has waited {waited_s:.0f} s"
            dead = refusing(group.probes)
            if dead:
                names = _where(t for t, _ in dead)
                log.warning("generation %d: %s: %s died (probe refused)", n,
                            context, names)
                self._coord.mark_broken(n, f"{names} died ({context}; probe refused)")
            elif reach:
                self.report_unreachable(group.assignment, context)
        except Exception:  # a thread of its own: nothing else would see it fail
            log.exception("probing generation %d's members failed", n)

    def report_unreachable(self, a: Assignment, context: str) -> None:
        """Probe ``a``'s roster and :meth:`name <_name_unreachable>` the members that do not
        answer."""
        try:
            problems = self._unreachable(a)
        except PeerElasticError as exc:  # this peer's own address, etcd: the rendezvous says
            log.debug("probing generation %d's members: %s", a.generation, exc)
            return
        self._name_unreachable(a, problems, context)

    def _name_unreachable(self, a: Assignment, problems: dict[str, str],
                          context: str = "") -> None:
        """Name the members in ``problems`` (from :meth:`_unreachable`) at once: ERROR lines,
        the record the leader reads (:mod:`peer_elastic.etcd.reach`: it leaves the smaller
        side of a cut out, so a member that keeps its lease but not its network stalls
        nobody for long), and an event."""
        if not problems:
            return
        for line in problems.values():
            log.error("generation %d: %s%s", a.generation, f"{context}: " if context else "",
                      line)
        self._reporter.report(a.generation, problems)  # first: it is what frees the others
        self._coord.record_event("unreachable peer", "; ".join(problems.values())[:1000],
                                      generation=a.generation)

    def _unreachable(self, a: Assignment) -> dict[str, str]:
        """Member id -> a line saying why, for each roster member whose advertised group
        address this peer cannot reach.

        Raises :class:`ConfigError` when this peer itself advertises a loopback address
        while a member on another host does not: nobody else can ever reach it.
        """
        coord = self._coord
        snap = coord.snapshot()
        mine = self.check_own_address(snap)
        others = [snap.members[m] for m in a.roster
                  if m != coord.member_id and m in snap.members]
        targets = [m for m in others if m.record.net_address and m.record.probe_port]
        if not targets:
            return {}
        timeout = self._probe_timeout_s()
        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            whys = list(pool.map(lambda m: probe(m.record.net_address, m.record.probe_port,
                                                 timeout), targets))
        return {m.id: f"{m.id} on host {m.host} advertises {m.record.net_address} for its "
                f"process groups, but this peer ({coord.member_id} on host {coord.host}, "
                f"{mine or 'no address'}) cannot reach "
                f"{host_port(m.record.net_address, m.record.probe_port)}: {why}; {FIX}"
                for m, why in zip(targets, whys, strict=True) if why is not None}

    def check_own_address(self, snap: ViewSnapshot) -> str:
        """This peer's advertised group address. Raises :class:`ConfigError` when it is a
        loopback address while a member on another host advertises a real one: nobody else
        can ever reach it. Checked before every rendezvous and while waiting as a standby
        (the others' reports cut such a peer off, so it may never reach a rendezvous)."""
        coord = self._coord
        me = snap.members.get(coord.member_id)
        mine = me.record.net_address if me is not None else ""
        if mine and is_loopback(mine):
            for m in snap.by_age:
                addr = m.record.net_address
                if addr and not is_loopback(addr) and m.host != coord.host:
                    raise ConfigError(
                        f"this peer ({coord.member_id}, host {coord.host}) advertises the "
                        f"loopback address {mine} for its process groups, but {m.id} on host "
                        f"{m.host} is at {addr}: no other host can reach it (etcd is reached "
                        f"over loopback here, so the route to etcd names no network "
                        f"interface); {FIX}")
        return mine

    def _probe_timeout_s(self) -> float:
        return max(0.5, min(2.0, self._collective_timeout_s / 4))

    def _probe_member(self, member_id: str) -> str | None:
        """Why ``member_id``'s group address does not answer now; None when it does, or when
        it is no member any more (for :class:`~peer_elastic.etcd.reach.ReachReporter`)."""
        m = self._coord.snapshot().members.get(member_id)
        if m is None or not m.record.net_address or not m.record.probe_port:
            return None
        return probe(m.record.net_address, m.record.probe_port, self._probe_timeout_s(),
                     attempts=1)

    def wait_reachable(self, a: Assignment, abort_reason: Callable[[], str | None]) -> bool:
        """Before ``init_process_group``: True once every roster member's address answers.

        Otherwise the unreachable members are named (ERROR, and an event) at once, not at
        gloo's timeout, and this waits (re-probing) until the generation is superseded (a
        dead member's lease ran out: False), the member answers (True), or the collective
        timeout has passed (marks the generation broken and returns False).
        """
        problems = self._unreachable(a)  # this peer's own ConfigError goes to its caller
        if not problems:
            return True
        self._name_unreachable(a, problems)
        deadline = time.monotonic() + self._collective_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if abort_reason() is not None:
                return False  # superseded (e.g. the unreachable member left): move on
            self._coord.check()
            problems = self._unreachable(a)
            if not problems:
                log.info("generation %d: every member is reachable now", a.generation)
                return True
            self._reporter.report(a.generation, problems)
        self._coord.mark_broken(a.generation, "unreachable: " + "; ".join(problems.values()))
        return False

    def why_forming_is_stuck(self, a: Assignment) -> str | None:
        """This rank has been forming ``a``'s group for longer than a join timeout: why it
        never will, or None while nothing says so.

        A roster member whose probe port refuses connections died there, after it
        acknowledged the generation (so the leader's ack wait misses it). Then the
        generation is marked broken, so that the leader writes the next one, and the reason
        is returned. Members that do not answer at all are reported unreachable; the
        cut-off rule then dooms the group (``CUT_OFF``) and the guard acts on that.

        Probes as the death prober does (:mod:`peer_elastic.etcd.deaths`): only a refusal
        is proof, and loopback addresses only in a job on loopback."""
        coord = self._coord
        snap = coord.snapshot()
        targets = probeable(snap, coord.member_id,
                            [m for i in a.roster if (m := snap.members.get(i)) is not None])
        if not targets:
            return None
        dead = [t for t, _ in refusing(targets)]
        if not dead:  # or cut off from this peer by the network
            self.report_unreachable(a, "the group has been forming for long")
            return None
        names = _where(dead)
        log.warning("generation %d: %s died while the group formed (probe refused)",
                    a.generation, names)
        self._coord.mark_broken(a.generation, f"{names} died while the group formed")
        return f"{names} died while the group formed (probe refused)"

