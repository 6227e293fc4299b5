"""``peer-elastic dashboard``: a small read-only web page of one job, served by the package.

A stdlib HTTP server (one thread per request) serves the page (:mod:`peer_elastic.ops.page`:
plain HTML and a script, no build step) and ``/api/state``, a JSON document the page polls
twice a second. The document is the ``status --json`` document plus the run's
:class:`~peer_elastic.ops.timeline.Timeline` (generations, recoveries, events, progress and
throughput). Nothing here writes to etcd. It binds loopback unless told otherwise: the
page names hosts, addresses and the job's settings, and it has no authentication of its
own; reach it through an SSH tunnel or a proxy that authenticates.

It answers only requests whose ``Host`` names it (:class:`~peer_elastic.ops.http_guard.
HostAllowList`: no DNS rebinding), closes a connection that has not sent its request within
``request_timeout_s``, and serves at most ``max_connections`` at once (one more is answered
503 at once): :mod:`peer_elastic.ops.http_guard`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from peer_elastic.errors import EtcdError
from peer_elastic.etcd.admin import last_seen, snapshot_document, status_document
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd.snapshot_records import list_snapshots
from peer_elastic.etcd.view import JobView, ViewSnapshot
from peer_elastic.ops import timeline as tl
from peer_elastic.ops.http_guard import ConnectionCap, HostAllowList, ReadDeadlines
from peer_elastic.ops.page import PAGE
from peer_elastic.process import threads

log = logging.getLogger(__name__)

#: How often the lease of every member is asked for its age (one request per member).
LAST_SEEN_EVERY_S = 1.0
#: A connection must send its request head within this, and each write to it must finish
#: within it; a browser's poll takes milliseconds.
REQUEST_TIMEOUT_S = 10.0
#: Connections served at once. The page polls with one short request at a time per tab.
MAX_CONNECTIONS = 32


class JobState:
    """The document ``/api/state`` serves, rebuilt when the job changes (and at most every
    :data:`LAST_SEEN_EVERY_S` for the members' last-seen times)."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.client = client
        self.job = job
        self.view = JobView(client, job)
        self._lock = threading.Lock()
        self._version = -1
        self._run_id = ""
        self._events: list[tl.Event] = []
        self._progress: list[tl.ProgressPoint] = []
        self._progress_complete = True
        self._seen: dict[str, int | None] = {}
        self._snapshots: list[dict[str, Any]] = []  # durable snapshots' records, oldest first
        self._seen_at = 0.0

    def start(self) -> JobState:
        self.view.start()
        return self

    def stop(self) -> None:
        self.view.stop()

    def document(self) -> dict[str, Any]:
        with self._lock:  # one rebuild at a time; requests in between share it
            snap = self.view.snapshot()
            now = time.time()
            if snap.run is None:
                return {"job": self.job, "status": None, "now": now,
                        "note": "no running run of this job in etcd (not started, or ended "
                                "longer ago than run_ttl_s)"}
            try:
                self._refresh(snap, now)
            except EtcdError as exc:  # show the last picture; say why it may be stale
                log.debug("dashboard refresh: %s", exc)
            status = status_document(self.job, snap, now, self._seen)
            # As `status --json` has it: the newest durable snapshot (job level, outlives runs).
            status["snapshot"] = self._snapshots[-1] if self._snapshots else None
            for m in status["members"]:
                m["ready_acked"] = m["id"] in snap.ready_for(status["generation"])
            timeline = tl.build(self._run_id, self._events, self._progress,
                                self._progress_complete)
            rates = timeline.throughput()
            return {
                "job": self.job, "now": now, "status": status,
                "steps_per_s": rates[-1][1] if rates else None,
                "snapshot_count": len(self._snapshots),
                "timeline": {
                    "generations": [asdict(g) for g in timeline.generations],
                    "recoveries": [asdict(r) for r in timeline.recoveries],
                    "events": [asdict(e) for e in timeline.events[-200:]],
                    "throughput": rates[-500:],
                    "progress_complete": timeline.progress_complete,
                },
                "phases": [{"key": k, "what": w} for k, w in tl.PHASES],
                "watch_connected": snap.connected_at > 0,
            }

    def _refresh(self, snap: ViewSnapshot, now: float) -> None:
        assert snap.run is not None
        keys = RunKeys(self.job, snap.run.run_id)
        if snap.run.run_id != self._run_id:  # a new run: its own history
            self._run_id = snap.run.run_id
            self._events, self._version = [], -1
            progress, self._progress_complete = tl.read_progress(self.client, keys)
            self._progress = sorted(progress, key=lambda p: p.unix)
        if snap.version != self._version:
            self._version = snap.version
            self._events = tl.read_events(self.client, keys)
            # Snapshot records live under the watched job prefix: a new one changes the view.
            self._snapshots = [snapshot_document(r) for r in list_snapshots(self.client, self.job)]
            p = snap.progress
            if p is not None and (not self._progress or p.unix > self._progress[-1].unix):
                self._progress.append(tl.ProgressPoint(p.unix, p.step, p.epoch, p.generation,
                                                       p.world_size))
                del self._progress[:-tl.MAX_PROGRESS_POINTS]
        if now - self._seen_at >= LAST_SEEN_EVERY_S:
            self._seen, self._seen_at = last_seen(self.client, snap), now


class _FirstSeen:
    """Which values were seen before (at most ``limit`` remembered): a page that keeps
    polling with a refused host name is logged once, not twice a second."""

    def __init__(self, limit: int = 100) -> None:
        self._seen: set[object] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def first(self, value: object) -> bool:
        with self._lock:
            if value in self._seen or len(self._seen) >= self._limit:
                return False
            self._seen.add(value)
            return True


def _handler(state: JobState, hosts: HostAllowList,
             deadlines: ReadDeadlines) -> type[BaseHTTPRequestHandler]:
    refused_hosts = _FirstSeen()

    class Handler(BaseHTTPRequestHandler):
        server_version = "peer-elastic-dashboard"
        timeout = deadlines.timeout_s  # each read and write of the connection (the stdlib's)

        def handle_one_request(self) -> None:
            deadlines.arm(self.connection)  # the request head must arrive in time
            try:
                super().handle_one_request()
            finally:
                deadlines.disarm(self.connection)

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            deadlines.disarm(self.connection)  # the head is in; answering may take a while
            host = self.headers.get("Host")
            if not hosts.allows(host):
                level = logging.WARNING if refused_hosts.first(host) else logging.DEBUG
                log.log(level, "dashboard: refused a request for host %r from %s (not one of "
                        "%s; --allow-host adds a name)", host, self.client_address[0],
                        sorted(hosts.names))
                self._send(403, "text/plain", b"this server does not answer for that host "
                           b"name; start the dashboard with --allow-host NAME to allow it\n")
                return
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, "text/html; charset=utf-8", PAGE.encode())
            elif path == "/api/state":
                body = json.dumps(state.document(), default=str).encode()
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            # The page's own inline script and style only; it loads nothing from elsewhere.
            self.send_header("Content-Security-Policy", "default-src 'self'; "
                             "script-src 'unsafe-inline'; style-src 'unsafe-inline'")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("dashboard: " + fmt, *args)

    return Handler


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most ``cap.limit`` of them; more are refused at once."""

    daemon_threads = True  # a browser's open connection must not hold up a stop

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 cap: ConnectionCap) -> None:
        if ":" in address[0]:  # an IPv6 literal such as ::1
            self.address_family = socket.AF_INET6
        self.cap = cap
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.cap.try_enter():
            log.warning("dashboard: %d connections open, refused one from %s",
                        self.cap.limit, client_address[0])
            self.cap.refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else will leave
            self.cap.leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.cap.leave()


class Dashboard:
    """The page and its JSON, served from a thread (``url`` once started)."""

    def __init__(self, client: EtcdClient, job: str, host: str = "127.0.0.1",
                 port: int = 8080, allowed_hosts: Iterable[str] = (),
                 request_timeout_s: float = REQUEST_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.state = JobState(client, job)
        self.hosts = HostAllowList(host, allowed_hosts)
        self.deadlines = ReadDeadlines(request_timeout_s)
        self.cap = ConnectionCap(max_connections)
        self._server = _Server((host, port), _handler(self.state, self.hosts, self.deadlines),
                               self.cap)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/"

    def start(self) -> Dashboard:
        self.state.start()
        self.deadlines.start()
        threads.start(self._server.serve_forever, "dashboard-http")  # until stop()'s shutdown
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.deadlines.stop()
        self.state.stop()
