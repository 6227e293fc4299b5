"""Fakes several unit-test modules share: a leader's writer, a clock, and a coordinator for
the training side."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from types import SimpleNamespace

from peer_elastic.etcd.coordinator import Assignment
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.etcd.writer import EventsPruned, Written
from peer_elastic.records import GenerationRecord, JobConfig
from tests.helpers.views import cfg, snap


class FakeClock:
    """A monotonic clock that moves only when a test moves it (``now``, :meth:`advance`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


# A leader's writer (peer_elastic.etcd.writer) that records each call in ``calls``.
class FakeWrites:
    def __init__(self, member_id: str, written: Written = Written.WRITTEN) -> None:
        self.member_id = member_id
        self.written = written
        self.calls: list[tuple] = []

    settled_at = 0.0  # what etcd_settled_at says
    recheck_reveals: float | None = None  # what a fresh read of etcd would make it say
    rechecks = 0

    def etcd_settled_at(self) -> float:
        return self.settled_at

    def recheck_etcd_settled_at(self) -> float:
        self.rechecks += 1
        if self.recheck_reveals is not None:
            self.settled_at = self.recheck_reveals
        return self.settled_at

    def event(self, kind, detail="", member_id=None, generation=0):  # noqa: ANN001, ANN201
        self.calls.append(("event", kind))

    pruned_at = 2  # the etcd revision a prune says a view must reach to have seen it

    def prune_events(self, keep: int) -> EventsPruned:
        self.calls.append(("prune", keep))
        return EventsPruned(deleted=0, revision=self.pruned_at)

    def write_done(self, success, reason, cause, generation, timeout_s=None):  # noqa: ANN001, ANN201
        self.calls.append(("done", success, cause))
        return True

    def count_host_failure(self, host, member_id, count, mod_revision):  # noqa: ANN001, ANN201
        self.calls.append(("failure", host, count))

    def blacklist_host(self, host, member_id, count, cooldown_s):  # noqa: ANN001, ANN201
        self.calls.append(("blacklist", host, count))

    def write_generation(self, snap, plan, detected_unix, silent=None):  # noqa: ANN001, ANN201
        if isinstance(self.written, Exception):
            raise self.written
        self.calls.append(("generation", plan.number, plan.roster, detected_unix))
        return self.written

    def revoke(self, lease_id: int) -> None:
        self.calls.append(("revoke", lease_id))


class FakeView:
    """The watched view a :class:`FakeCoordinator` shows: ``current`` (a test replaces it)."""

    def __init__(self, current: ViewSnapshot) -> None:
        self.current = current
        self.wakes = 0

    def snapshot(self) -> ViewSnapshot:
        return self.current

    def wait_change(self, version: int, timeout: float,
                    until: Callable[[], bool] | None = None) -> int:
        time.sleep(min(timeout, 0.01))  # nothing ever changes by itself here
        return self.current.version

    def wake(self) -> None:
        self.wakes += 1

    def wait_for(self, predicate: Callable[[ViewSnapshot], bool],
                 timeout: float) -> ViewSnapshot | None:
        return self.current if predicate(self.current) else None


class FakeCoordinator:
    """A coordinator for the training side's unit tests, with no etcd: what a ``Peer`` uses
    of one (``peer_elastic.elastic.PeerCoordinator``, hence what its group manager, state
    keeping and publisher use). Its view shows ``view.current``; its writes are recorded in
    ``calls``; a test sets any attribute it needs otherwise."""

    def __init__(self, config: JobConfig | None = None, *, member_id: str = "m0",
                 incarnation: int = 0) -> None:
        self.member_id, self.job, self.host = member_id, "job", "host"
        self.local_rank, self.lease_id = 0, 0
        self.incarnation = incarnation
        self.error = None
        self.drain_requested = threading.Event()
        self.config = config if config is not None else cfg()
        self.client = SimpleNamespace(endpoints=())  # no etcd to tell apart from peers
        self.run = None
        self.keys = None
        self.writer = None  # no registration: what a peer would write is dropped
        self.view = FakeView(snap([]))
        self.is_leader = False
        self.counters = CoordinatorCounters()
        self.rejoin_gate: Callable[[], bool] | None = None
        self.calls: list[tuple] = []

    def snapshot(self) -> ViewSnapshot:
        return self.view.snapshot()

    @property
    def latest_generation(self) -> GenerationRecord | None:
        return self.view.current.generation

    def check(self, snap: ViewSnapshot | None = None) -> None:
        pass

    def hold_rejoin(self, until: Callable[[], bool] | None) -> None:
        self.rejoin_gate = until

    def wait_generation(self, after: int = 0, timeout: float | None = None) -> Assignment:
        raise TimeoutError("no generation in a fake coordinator")

    def wait_ready(self, generation: int, timeout: float | None = None) -> bool:
        return False

    def mark_broken(self, generation: int, detail: str = "") -> bool:
        self.calls.append(("mark_broken", generation, detail))
        return True

    def report_unreachable(self, members: Collection[str], generation: int) -> bool:
        self.calls.append(("report_unreachable", tuple(members), generation))
        return True

    def clear_unreachable(self) -> bool:
        self.calls.append(("clear_unreachable",))
        return True

    def record_event(self, kind: str, detail: str = "", member_id: str | None = None,
                     generation: int | None = None,
                     timings: Mapping[str, float] | None = None) -> None:
        self.calls.append(("event", kind, generation))

    def record_state(self, commits: int, generation: int) -> None:
        self.calls.append(("state", commits, generation))

    def record_progress(self, **fields: int) -> None:
        self.calls.append(("progress", fields))

    def finish(self, success: bool = True, reason: str = "", timeout_s: float = 0.0) -> bool:
        self.calls.append(("finish", success, reason))
        return True

    def close(self, leave: bool = True) -> None:
        self.calls.append(("close", leave))
