"""Members cut off from the others' process groups: who reports them, and who goes.

A member can keep its lease (it reaches etcd) and still be unreachable to the other
members' process groups: a broken data network, a firewall, a partition between hosts that
leaves etcd on both sides. Its lease never ends, so nothing else drops it, and every
generation that lists it fails to form: measured on three hosts with one cut off from the
other two but not from etcd, nobody trained until the cut healed.

So a member that cannot reach a roster member's advertised address (the group manager
probes every one before each rendezvous, :mod:`peer_elastic.torch.group`) says so in etcd,
in a :class:`~peer_elastic.records.ReachRecord` under its own lease, and every member
computes the same *cut-off* set from the reports (:func:`cut_off`). The reports are edges
of a graph, "a cannot reach b" joining a and b; while an edge remains, the member on the
most edges goes; of a tie, one that is already out of the current roster, then the one
more members report, then the youngest. A member alone on the far side of a partition goes
(every other member reports it, and it reports every other); of two equal halves, the one
holding the oldest member stays. Preferring who is already out keeps a healing cut from
flapping: the reports go one by one as their re-probes answer, and the last edge left (two
members that each still report the other) then takes out the member that was cut off, not
the one that trained through the cut, which the older-stays rule alone did (seen in a
seeded schedule on three hosts: one extra generation each way while the cut healed).
Preferring the reported member keeps the first report of a cut from taking out the healthy
member that wrote it: the members that probe a cut-off one report a single edge each,
while the cut-off member reports every member it probed at once; when a healthy member's
single edge reached etcd first, the younger-goes rule took that healthy member out until
the other reports arrived (seen on three hosts, and that generation's collective then
waited out its timeout). Cut-off members are not eligible
(:meth:`~peer_elastic.etcd.view.ViewSnapshot.eligible`), so the leader writes a generation
without them, and they wait as registered standbys.

A report stays true while it exists: :class:`ReachReporter` re-probes the members it named
every second, rewrites the record as they answer and deletes it once all do. The cut-off
member reports the others, and re-probes them, alike. Once no report names it, it is
eligible again and joins at the next generation like any standby.

One job: the rule and the reports. Probing an address, and the etcd writes, are the
caller's (callables), so the rule and the reporter are tested without a network.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

from peer_elastic.process import threads

__all__ = ["ReachReporter", "cut_off"]

log = logging.getLogger(__name__)

#: How often a reporter re-probes the members it reported.
REPROBE_S = 1.0


def cut_off(reports: Mapping[str, Collection[str]], by_age: Sequence[str],
            roster: Collection[str] = ()) -> frozenset[str]:
    """The members to leave out of rosters, given ``reports`` (reporter -> the members it
    cannot reach), the live members ``by_age`` (oldest first) and the current ``roster``.
    Edges between members that are not both live are ignored (a dead member's key goes;
    its report goes with its lease). Of the members on the most edges, one already out of
    the roster goes first, then one reported by more members, then the youngest: a cut heals
    report by report (each reporter withdraws when its own re-probe answers), and the last
    edge left must not take out the side that trained through the cut; and the first report
    of a cut is often a single edge (a healthy member that probed the cut-off one), which
    must not take out its reporter. Deterministic: every member computes the same set from
    the same snapshot."""
    age = {m: i for i, m in enumerate(by_age)}
    training = frozenset(roster)
    arcs = {(a, b) for a, seen in reports.items() if a in age
            for b in seen if b in age and b != a}
    gone: set[str] = set()
    while arcs:
        edges = {frozenset(arc) for arc in arcs}
        degree = Counter(m for e in edges for m in e)
        reported = Counter(b for _, b in arcs)
        victim = max(degree, key=lambda m: (degree[m], m not in training, reported[m], age[m]))
        gone.add(victim)
        arcs = {(a, b) for a, b in arcs if victim not in (a, b)}
    return frozenset(gone)


class ReachReporter:
    """Keeps this member's report of unreachable members true; see the module docstring.

    ``write(members, generation)`` puts the record (best effort), ``erase()`` deletes it,
    and ``probe(member_id)`` returns None when the member answers now or is no longer a
    member (nothing to report), else why not.
    """

    def __init__(self, write: Callable[[frozenset[str], int], None],
                 erase: Callable[[], None], probe: Callable[[str], str | None],
                 reprobe_s: float = REPROBE_S) -> None:
        self._write, self._erase, self._probe = write, erase, probe
        self._reprobe_s = reprobe_s
        self._cond = threading.Condition()
        self._writing = threading.Lock()  # writes go out one at a time, each the newest state
        self._reported: frozenset[str] = frozenset()
        self._generation = 0
        self._thread: threading.Thread | None = None  # set while the re-probing runs
        self._closed = False

    @property
    def reported(self) -> frozenset[str]:
        with self._cond:
            return self._reported

    def report(self, generation: int, unreachable: Collection[str]) -> None:
        """``unreachable`` did not answer while forming ``generation``: add them to the
        record (written now, on the caller's thread) and keep re-probing them."""
        with self._cond:
            merged = self._reported | frozenset(unreachable)
            if self._closed or merged == self._reported:
                return
            self._reported, self._generation = merged, generation
            if self._thread is None:
                self._thread = threads.start(self._run, "peer-elastic-reach")
        self._publish()

    def close(self, erase: bool = True) -> None:
        """Stop re-probing; delete the record unless ``erase`` is False (its lease ends)."""
        with self._cond:
            self._closed = True
            had, self._reported = self._reported, frozenset()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=5.0)
        if had and erase:
            self._publish()

    def _publish(self) -> None:
        """Write what is reported now (or delete the record when nothing is)."""
        with self._writing:
            with self._cond:
                current, generation = self._reported, self._generation
            if current:
                self._write(current, generation)
            else:
                self._erase()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=self._reprobe_s)
                if self._closed:
                    return
                if not self._reported:  # under the lock: a report() now starts a new thread
                    self._thread = None
                    return
                named = self._reported
            answered = {m for m in named if self._probe(m) is None}
            if not answered:
                continue
            with self._cond:
                if self._closed:
                    return
                self._reported -= answered
            log.info("reachable again: %s", ", ".join(sorted(answered)))
            self._publish()
