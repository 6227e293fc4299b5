"""What a peer reports about itself: its counters and its step timings.

* :class:`PeerStats` is owned by :class:`~peer_elastic.elastic.Peer`; the parts below it
  (the group manager, the hang watchdog) report into it through its methods.
* :class:`StepObserver` is what the peer tells about each step: a check or commit (timed),
  a sync after a reset, a reset. :class:`NoObserver` ignores everything and is the default;
  :class:`peer_elastic.metrics.PeerMetrics` turns the calls into Prometheus metrics.
* :func:`observed` wraps a state's checker (``Peer._check``, attached with
  ``state.attach``) so that every ``commit()`` and ``check_host_updates()`` is timed.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol, TypeVar

from peer_elastic.errors import HostsUpdatedInterrupt
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.records import GenerationRecord, JobConfig

__all__ = ["NoObserver", "ObservedCoordinator", "ObservedPeer", "PeerStats", "StepObserver", "observed"]

S = TypeVar("S")


@dataclasses.dataclass
class PeerStats:
    """Counters of what this peer's training side did (the coordinator keeps its own)."""

    #: Groups whose stuck collectives this peer abandoned because a member's lease ended.
    collectives_abandoned: int = 0
    #: Durable snapshots this peer wrote, failed to write (disk full, permissions, a failed
    #: staging copy: training went on), and skipped because the previous write was still in
    #: flight.
    snapshots_written: int = 0
    snapshots_failed: int = 0
    snapshots_skipped: int = 0
    #: Plain checks that ran the generation exchange themselves, and those that returned
    #: without one, between two (checks coming fast: peer_elastic.torch.check.check_cadence).
    check_exchanges: int = 0
    checks_spaced: int = 0
    #: Groups this peer formed with no holder of a state that had commits: every peer that
    #: held it was lost at once (peer_elastic.state.lost_state).
    states_lost: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def collective_abandoned(self) -> None:
        """The group manager abandoned a group's collectives."""
        with self._lock:
            self.collectives_abandoned += 1

    def count(self, name: str) -> None:
        """Add one to counter ``name`` (one of the fields above)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class ObservedCoordinator(Protocol):
    """What an observer may read from the bound peer's coordinator."""

    job: str
    host: str
    config: JobConfig
    #: What the coordination thread did (generations written, CAS lost, rejoins, ...).
    counters: CoordinatorCounters

    @property
    def latest_generation(self) -> GenerationRecord | None: ...

    def snapshot(self) -> ViewSnapshot: ...


class ObservedPeer(Protocol):
    """What an observer may read from the peer it is bound to, at any time (metrics read
    their gauges here at every scrape): :class:`~peer_elastic.elastic.Peer` is one."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    #: The peer's training-side counters.
    stats: PeerStats
    coordinator: ObservedCoordinator


class StepObserver(Protocol):
    """What :class:`~peer_elastic.elastic.Peer` tells an observer (metrics) about its steps."""

    def bind(self, peer: ObservedPeer) -> None:
        """The peer that will report (read its live values from here, if you like)."""

    def on_check(self, seconds: float, *, committing: bool) -> None:
        """A ``check_host_updates()`` (``committing``: a ``commit()``) took ``seconds``.

        Told also when it ended in :class:`HostsUpdatedInterrupt` (the check ran), never when
        its collective failed."""

    def on_sync(self, seconds: float) -> None:
        """Agreeing on and syncing state after a reset took ``seconds`` (only when synced)."""

    def on_reset(self, causes: Collection[int], seconds: float, *, crashed: bool,
                 lease_lost: bool) -> None:
        """A reset (not the first group) took ``seconds``. ``causes`` are the generation's
        (:class:`~peer_elastic.records.GenerationCause` values);
        ``crashed``: this peer restored its last commit; ``lease_lost``: it re-registered."""


class NoObserver:
    """A :class:`StepObserver` that ignores everything (the default)."""

    def bind(self, peer: Any) -> None:
        pass

    def on_check(self, seconds: float, *, committing: bool) -> None:
        pass

    def on_sync(self, seconds: float) -> None:
        pass

    def on_reset(self, causes: Collection[int], seconds: float, *, crashed: bool,
                 lease_lost: bool) -> None:
        pass


def observed(check: Callable[[S, bool], None],
             observer: StepObserver) -> Callable[[S, bool], None]:
    """``check(state, committing)``, with its duration told to ``observer``.

    A check that ends in :class:`HostsUpdatedInterrupt` is told (it ran); one that fails
    otherwise (a peer died mid-collective) is not.
    """
    clock = time.perf_counter
    on_check = observer.on_check

    def timed(state: S, committing: bool) -> None:
        t0 = clock()
        try:
            check(state, committing)
        except HostsUpdatedInterrupt:
            on_check(clock() - t0, committing=committing)
            raise
        on_check(clock() - t0, committing=committing)

    return timed
