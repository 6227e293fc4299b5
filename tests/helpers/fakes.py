"""Fakes several unit-test modules share: a leader's writer and a clock."""

from __future__ import annotations

from peer_elastic.etcd.writer import Written


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

    def prune_events(self, keep: int) -> int:
        self.calls.append(("prune", keep))
        return 0

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
