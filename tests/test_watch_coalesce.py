"""PrefixWatch hands a consumer that fell behind every queued response in one delivery,
in order, and still handles what follows them (an error). Fake client: the real watch
runs in every coordination test."""

from __future__ import annotations

import threading

from peer_elastic.etcd.client import KeyValue, WatchEvent
from peer_elastic.etcd.watch import PrefixWatch

WAIT_S = 20.0


def _put(rev: int) -> WatchEvent:
    return WatchEvent("put", KeyValue(f"/p/k{rev}", b"v", rev, rev, 1, 0))


class FakeWatchClient:
    def __init__(self) -> None:
        self.watches: list[tuple] = []  # (on_events, on_error, start_revision)
        self.created = threading.Condition()

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return [], 1

    def watch_prefix(self, prefix, on_events, on_error, start_revision) -> int:  # noqa: ANN001
        with self.created:
            self.watches.append((on_events, on_error, start_revision))
            self.created.notify_all()
            return len(self.watches)

    def cancel_watch(self, watch_id: int) -> None:
        return None

    def wait_watches(self, n: int) -> bool:
        with self.created:
            return self.created.wait_for(lambda: len(self.watches) >= n, WAIT_S)


def test_a_backlog_is_delivered_at_once_in_revision_order() -> None:
    client = FakeWatchClient()
    deliveries: list[tuple[list[int], int]] = []
    busy = threading.Event()
    release = threading.Event()
    delivered = threading.Condition()

    def on_events(events: list[WatchEvent], rev: int) -> None:
        busy.set()
        assert release.wait(WAIT_S)  # the consumer is slow: responses queue up meanwhile
        with delivered:
            deliveries.append(([e.kv.mod_revision for e in events], rev))
            delivered.notify_all()

    watch = PrefixWatch(client, "/p/", lambda kvs, rev: None, on_events)  # type: ignore[arg-type]
    watch.start()
    try:
        assert client.wait_watches(1)
        send, fail, start = client.watches[0]
        assert start == 2
        send([_put(2)], 2)
        assert busy.wait(WAIT_S)
        for rev in range(3, 53):
            send([_put(rev)], rev)
        fail(ConnectionError("stream cut"))  # queued behind the backlog
        release.set()
        with delivered:
            assert delivered.wait_for(lambda: len(deliveries) == 2, WAIT_S)
        assert deliveries[0] == ([2], 2)
        assert deliveries[1] == (list(range(3, 53)), 52)
        assert client.wait_watches(2)  # the error after the backlog was still handled
        assert client.watches[1][2] == 53  # resumed right after the last delivered revision
        assert watch.revision == 52
    finally:
        release.set()
        watch.stop()
