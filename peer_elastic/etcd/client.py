"""The one place peer-elastic talks to etcd.

Wraps the ``etcd3`` module from the ``cslab-etcd3`` distribution and builds what it lacks:

* endpoints are always a ``MultiEndpointEtcd3Client`` with failover and a short
  ``time_retry`` (the client's default marks an endpoint failed for 300 s, so a restarted
  single server would stay unusable for five minutes);
* transient failures (endpoint down, leader election, "no server available") are retried with
  bounded exponential backoff, and when the budget runs out the error names the endpoints
  and how long it tried; raw ``grpc.RpcError`` objects are mapped onto
  :mod:`peer_elastic.errors` types (both in :mod:`~peer_elastic.etcd.calls`);
* user/password auth works on a plaintext channel (the token travels as metadata, the way
  etcd's own clients do it) and an expired token is renewed transparently.

Nothing above this module (and :mod:`~peer_elastic.etcd.calls` and
:mod:`~peer_elastic.etcd.lease_streams`) imports ``etcd3`` or ``grpc``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions as etcd_exc
import grpc
from etcd3 import etcdrpc

from peer_elastic import settings_table
from peer_elastic.errors import (
    ClientClosed,
    ConfigError,
    EtcdAuthError,
    EtcdError,
    EtcdRequestTooLarge,
    EtcdUnavailable,
    LeaseNotFound,
)
from peer_elastic.etcd.calls import (
    DisruptionClock,
    FaultInjection,
    RetriedCalls,
    is_transient,
    map_error,
    rpc_details,
)
from peer_elastic.etcd.lease_streams import LeaseStreams
from peer_elastic.etcd.tls import (
    CA_VAR,
    CERT_VAR,
    KEY_VAR,
    TLSConfig,
)
from peer_elastic.process import threads

log = logging.getLogger(__name__)

T = TypeVar("T")

ENV_ENDPOINTS = settings_table.ETCD.env
DEFAULT_PORT = 2379


# --- endpoints ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EndpointSpec:
    """One etcd endpoint as the user wrote it: ``host:port`` or ``http(s)://host:port``."""

    host: str
    port: int
    secure: bool

    @property
    def bracketed_host(self) -> str:
        """The host as a gRPC target or URL needs it: IPv6 addresses in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def netloc(self) -> str:
        return f"{self.bracketed_host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.netloc}"


def parse_endpoints(spec: str | Sequence[str]) -> list[EndpointSpec]:
    """Parse a comma-separated endpoint list; raise :class:`EtcdError` with the bad item.

    A bare ``host`` gets port 2379; ``https://`` marks the endpoint as TLS. IPv6 hosts are
    written in brackets (``[::1]:2379``).
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[EndpointSpec] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        secure = False
        if "://" in item:
            scheme, item = item.split("://", 1)
            if scheme not in ("http", "https"):
                raise EtcdError(f"bad etcd endpoint {raw.strip()!r}: scheme must be http or https")
            secure = scheme == "https"
        item = item.rstrip("/")
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_s = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, port_s = item.split(":")
        else:
            host, port_s = item, ""
        if not host or "/" in host:
            raise EtcdError(f"bad etcd endpoint {raw.strip()!r}: expected host:port")
        try:
            port = int(port_s) if port_s else DEFAULT_PORT
        except ValueError:
            raise EtcdError(f"bad etcd endpoint {raw.strip()!r}: port {port_s!r} is not a number") from None
        if not 0 < port < 65536:
            raise EtcdError(f"bad etcd endpoint {raw.strip()!r}: port out of range")
        out.append(EndpointSpec(host, port, secure))
    if not out:
        raise EtcdError(
            f"no etcd endpoint given (pass --etcd host:port[,host:port...] or set {ENV_ENDPOINTS})"
        )
    return out


# --- values returned to callers -------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stored it. ``create_revision`` is the key's age; 0 never occurs."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: Any) -> KeyValue:
        return cls(
            key=kv.key.decode("utf-8", "replace"),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True)
class WatchEvent:
    """A put or a delete seen by a watch. For deletes ``value`` is empty."""

    kind: str  # "put" | "delete"
    kv: KeyValue


# Compare/ops for transactions are the client's own small value objects; re-export the
# builder so callers do not import etcd3 themselves.
class Txn:
    """Builders for transaction compares and operations."""

    @staticmethod
    def version(key: str) -> Any:
        return etcd3.transactions.Version(key)

    @staticmethod
    def mod(key: str) -> Any:
        return etcd3.transactions.Mod(key)

    @staticmethod
    def create(key: str) -> Any:
        return etcd3.transactions.Create(key)

    @staticmethod
    def value(key: str) -> Any:
        return etcd3.transactions.Value(key)

    @staticmethod
    def put(key: str, value: bytes, lease: int | None = None) -> Any:
        return etcd3.transactions.Put(key, value, lease=lease)

    @staticmethod
    def delete(key: str, prefix: bool = False) -> Any:
        if prefix:
            return etcd3.transactions.Delete(key, range_end=etcd3.utils.prefix_range_end(
                etcd3.utils.to_bytes(key)))
        return etcd3.transactions.Delete(key)

    @staticmethod
    def delete_range(start: str, end: str) -> Any:
        """Delete every key in [start, end)."""
        return etcd3.transactions.Delete(start, range_end=end)

    @staticmethod
    def get(key: str) -> Any:
        return etcd3.transactions.Get(key)


#: How long :meth:`EtcdClient.close` waits for the threads of its watch streams to end.
CLOSE_WAIT_S = 5.0
#: What etcd3 (cslab-etcd3 0.12.1) names the thread of a ``Watcher``, with ``id(watcher)``;
#: tests/test_exit.py checks that a client still finds its watch thread by it.
_WATCH_THREAD_NAME = "etcd3_watch_%x"


# --- the client ------------------------------------------------------------------------------------

# gRPC backs off reconnecting exponentially (1 s, 1.6 s, 2.6 s, ... up to 2 min). After an etcd
# restart that can delay the first keep-alive past a short lease TTL, although etcd itself
# is back and has restored the lease with its full TTL. Reconnect quickly and often instead.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def _open_channels(endpoints: Sequence[EndpointSpec], tls: TLSConfig | None, timeout_s: float,
                   endpoint_retry_s: float) -> etcd3.MultiEndpointEtcd3Client:
    """etcd3's client over ``endpoints``, failing over between them; TLS with ``tls``'s
    files, or when an endpoint says https (the caller checked that ``tls`` is then given)."""
    secure = tls is not None or any(e.secure for e in endpoints)
    creds = None
    if tls is not None:
        files = tls.load()  # checked here: gRPC aborts the process on a cert without key
        creds = grpc.ssl_channel_credentials(
            root_certificates=files.ca_cert, private_key=files.key,
            certificate_chain=files.cert)
    eps = [
        etcd3.Endpoint(e.bracketed_host, e.port, secure=secure, creds=creds,
                       time_retry=endpoint_retry_s, opts=_CHANNEL_OPTIONS)
        for e in endpoints
    ]
    # Auth is done by hand (_PasswordAuth), so the client never attaches call
    # credentials to a plaintext channel (gRPC refuses that).
    return etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)


class _WatchThreads:
    """The threads etcd3 runs one client's watch streams on (named after its ``Watcher``; a
    failover makes a new one), remembered so that closing the client can wait for them."""

    def __init__(self) -> None:
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._lock = threading.Lock()

    def note(self, watcher: Any) -> None:
        """Remember the thread of ``watcher``'s stream, which just started."""
        name = _WATCH_THREAD_NAME % id(watcher)
        with self._lock:
            self._threads.update(t for t in threading.enumerate() if t.name == name)

    def alive(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in self._threads if t.is_alive()]


class _PasswordAuth:
    """etcd user/password auth done by hand: the token travels as plain metadata on every
    call, watches included, and is asked for again when it expires."""

    def __init__(self, user: str, password: str) -> None:
        self._user, self._password = user, password
        self._lock = threading.Lock()

    def authenticate(self, raw: etcd3.MultiEndpointEtcd3Client, timeout_s: float) -> None:
        with self._lock:
            req = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
            resp = raw.authstub.Authenticate(req, timeout_s)
            # Token as plain metadata on every call, watches included.
            raw.metadata = (("token", resp.token),)
            raw.call_credentials = None
            # Watchers capture metadata when built; drop them so new ones see the token.
            raw._clear_old_stubs()


class EtcdClient:
    """A thread-safe etcd v3 client with failover, bounded retries and typed errors.

    ``retry_budget_s`` bounds how long one call keeps retrying transient failures; past it the
    call raises :class:`EtcdUnavailable`. ``timeout_s`` is the per-attempt gRPC deadline.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = 2.0,
        retry_budget_s: float = 15.0,
        tls: TLSConfig | None = None,
        user: str | None = None,
        password: str | None = None,
        endpoint_retry_s: float = 0.5,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        if (user is None) != (password is None):
            raise EtcdAuthError("etcd auth needs both a user and a password")
        secure = tls is not None or any(e.secure for e in self.endpoints)
        if secure and tls is None:
            raise EtcdError(
                f"an https:// etcd endpoint needs a CA certificate (set {CA_VAR})"
            )
        if user is not None and not secure:
            _warn_plaintext_password(self.describe())
        self._raw = _open_channels(self.endpoints, tls, timeout_s, endpoint_retry_s)
        self._closed = False
        # Held while a watch is created and while the client closes: a watch created on a
        # channel closing under it starts etcd3's stream thread on the closed channel, which
        # dies with "Cannot invoke RPC: Channel closed!" (a loaded machine, seen in a run).
        self._closing = threading.Lock()
        self._watch_threads = _WatchThreads()
        self._disruptions = DisruptionClock()
        self._auth = None if user is None else _PasswordAuth(user, password or "")
        self._calls = RetriedCalls(self.describe, secure, self._disruptions.transient_failure,
                                   self._authenticate if self._auth is not None else None)
        self._lease_streams = LeaseStreams(self._raw, self.timeout_s, self._call,
                                           self._disruptions.note_header)
        if self._auth is not None:
            self._call(self._authenticate, "authenticate")

    # -- plumbing ---------------------------------------------------------------------------------

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def _authenticate(self) -> None:
        assert self._auth is not None
        self._auth.authenticate(self._raw, self.timeout_s)

    @property
    def disrupted_at(self) -> float:
        """When etcd was last seen disrupted (see :class:`DisruptionClock`); 0: never."""
        return self._disruptions.at

    @property
    def faults(self) -> FaultInjection | None:
        """Tests only: faults injected into every request (see :class:`FaultInjection`)."""
        return self._calls.faults

    @faults.setter
    def faults(self, faults: FaultInjection | None) -> None:
        self._calls.faults = faults

    def _call(self, fn: Callable[[], T], what: str, budget_s: float | None = None) -> T:
        """Run ``fn`` with retries on transient errors; map every failure to our types."""
        def attempt() -> T:
            # Asked before every attempt: the client may close while a call is retried, and
            # the closed channel would fail it anyway, in etcd3's threads too.
            if self._closed:
                raise ClientClosed(f"{what}: the etcd client was closed")
            return fn()

        return self._calls.run(attempt, what,
                               self.retry_budget_s if budget_s is None else budget_s)

    # -- key-value --------------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        def do() -> KeyValue | None:
            resp = self._raw.get_response(key)
            self._disruptions.note_header(resp.header)
            return KeyValue.from_pb(resp.kvs[0]) if resp.kvs else None

        return self._call(do, f"get {key}")

    def get_at(self, key: str, revision: int) -> KeyValue | None:
        """``key`` as it was at ``revision`` (its history, until etcd compacts it: then
        :class:`RevisionCompacted`)."""
        def do() -> KeyValue | None:
            resp = self._raw.get_range_response(key, None, revision=revision)
            self._disruptions.note_header(resp.header)
            return KeyValue.from_pb(resp.kvs[0]) if resp.kvs else None

        return self._call(do, f"get {key} at revision {revision}")

    def get_prefix(self, prefix: str, page_size: int = 1000) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at.

        Read in pages of at most ``page_size`` keys, every page at the revision of the first,
        so the result is one consistent picture however large: a single answer over gRPC's
        4 MiB receive limit would fail, every time (an event log that grew, a big store). A
        page still over the limit is read again in halves.
        """
        end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
        for _attempt in range(5):
            start: bytes = etcd3.utils.to_bytes(prefix)
            revision: int | None = None
            limit = max(1, page_size)
            out: list[KeyValue] = []
            try:
                while True:
                    try:
                        resp = self._call(
                            lambda s=start, r=revision, n=limit: self._raw.get_range_response(
                                s, end, limit=n, revision=r), f"get prefix {prefix}")
                    except EtcdRequestTooLarge:
                        if limit == 1:
                            raise
                        limit = max(1, limit // 2)
                        continue
                    self._disruptions.note_header(resp.header)
                    if revision is None:
                        revision = resp.header.revision
                    out += [KeyValue.from_pb(kv) for kv in resp.kvs]
                    if not resp.more or not resp.kvs:
                        return out, revision
                    start = resp.kvs[-1].key + b"\0"
            except EtcdError as exc:
                if "compacted" not in str(exc):
                    raise
                # The revision of the first page was compacted mid-read: read again, newer.
                log.info("get prefix %s: %s; reading again", prefix, exc)
        raise EtcdError(f"get prefix {prefix}: etcd compacted each revision the read started at")

    def first_keys(self, prefix: str, limit: int) -> list[str]:
        """The first ``limit`` keys under ``prefix`` in key order (keys only: no values)."""

        def do() -> list[str]:
            resp = self._raw.get_prefix_response(prefix, limit=limit, keys_only=True)
            self._disruptions.note_header(resp.header)
            return [kv.key.decode("utf-8", "replace") for kv in resp.kvs]

        return self._call(do, f"list keys {prefix}")

    def count_prefix(self, prefix: str) -> int:
        """How many keys lie under ``prefix`` now (counted by etcd; nothing is read)."""

        def do() -> int:
            resp = self._raw.get_prefix_response(prefix, count_only=True)
            self._disruptions.note_header(resp.header)
            return int(resp.count)

        return self._call(do, f"count keys {prefix}")

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Store ``value``; returns the revision of the write."""

        def do() -> int:
            header = self._raw.put(key, value, lease=lease).header
            self._disruptions.note_header(header)
            return header.revision

        return self._call(do, f"put {key}")

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete a key (or every key under a prefix); returns how many were deleted."""

        def do() -> int:
            if prefix:
                return self._raw.delete_prefix(key).deleted
            return self._raw.delete(key, return_response=True).deleted

        return self._call(do, f"delete {key}")

    def txn(
        self, compare: Iterable[Any], success: Iterable[Any] = (), failure: Iterable[Any] = ()
    ) -> tuple[bool, list[Any]]:
        """One atomic transaction; range results come back as lists of :class:`KeyValue`."""
        compare, success, failure = list(compare), list(success), list(failure)

        def do() -> tuple[bool, list[Any]]:
            ok, responses = self._raw.transaction(compare=compare, success=success, failure=failure)
            out: list[Any] = []
            for r in responses:
                if isinstance(r, list):
                    out.append([
                        KeyValue(meta.key.decode("utf-8", "replace"), bytes(value),
                                 meta.create_revision, meta.mod_revision, meta.version,
                                 meta.lease_id)
                        for value, meta in r
                    ])
                else:
                    out.append(r)
            return ok, out

        first = next((op.key for op in [*compare, *success] if hasattr(op, "key")), "")
        return self._call(do, f"transaction on {first}" if first else "transaction")

    def create(self, key: str, value: bytes, lease: int | None = None) -> tuple[bool, KeyValue | None]:
        """Create ``key`` only if absent. Returns (created, the existing value if not)."""
        ok, resp = self.txn(
            [Txn.version(key) == 0], [Txn.put(key, value, lease)], [Txn.get(key)]
        )
        if ok:
            return True, None
        existing = resp[0][0] if resp and resp[0] else None
        return False, existing

    def compare_and_put(
        self, key: str, value: bytes, mod_revision: int, lease: int | None = None,
        extra_compare: Iterable[Any] = (), extra_ops: Iterable[Any] = (),
    ) -> bool:
        """Put only if ``key`` is still at ``mod_revision`` (0: still absent)."""
        guard = Txn.version(key) == 0 if mod_revision == 0 else Txn.mod(key) == mod_revision
        ok, _ = self.txn([guard, *extra_compare], [Txn.put(key, value, lease), *extra_ops])
        return ok

    def compact(self, revision: int) -> None:
        self._call(lambda: self._raw.compact(revision, physical=True), f"compact {revision}")

    def revision(self) -> int:
        """The store's current revision (one cheap range request)."""
        return self._call(lambda: self._raw.get_response("\0").header.revision, "revision")

    # -- leases ------------------------------------------------------------------------------------

    def grant(self, ttl_s: float) -> int:
        ttl = max(1, int(round(ttl_s)))
        return self._call(lambda: self._raw.lease(ttl).id, f"grant lease ttl={ttl}")

    def keepalive(self, lease_id: int, budget_s: float | None = None) -> int:
        """One keep-alive round trip; returns the new TTL. Raises LeaseNotFound when gone.

        "Gone" is only reported when etcd says so twice: a keep-alive answer with TTL 0 is
        confirmed with a TimeToLive request, because a stream cut short while etcd restarts
        looks the same as a missing lease to a careless caller, and revoking a good lease
        would throw a healthy peer out of the job.
        """

        def do() -> int:
            responses = list(self._raw.refresh_lease(lease_id))
            if not responses:
                raise etcd_exc.ConnectionFailedError()  # stream ended without an answer
            self._disruptions.note_header(responses[-1].header)
            return responses[-1].TTL

        what = f"keep lease {lease_id:x} alive"
        ttl = self._call(do, what, budget_s)
        if ttl <= 0:
            remaining = self._call(lambda: self._raw.get_lease_info(lease_id).TTL, what, budget_s)
            if remaining <= 0:
                raise LeaseNotFound(f"lease {lease_id:x} expired or was revoked")
            ttl = remaining
        return ttl

    def keepalive_many(self, lease_ids: Sequence[int],
                       budget_s: float | None = None) -> dict[int, int]:
        """Keep several leases alive over one stream: lease id -> the TTL etcd answered
        (see :meth:`LeaseStreams.keepalive_many`)."""
        return self._lease_streams.keepalive_many(lease_ids, budget_s)

    def lease_ttls(self, lease_ids: Sequence[int],
                   budget_s: float | None = None) -> dict[int, int]:
        """Seconds left on each of several leases, -1 for one etcd does not know, asked
        side by side (see :meth:`LeaseStreams.lease_ttls`)."""
        return self._lease_streams.lease_ttls(lease_ids, budget_s)

    def revoke(self, lease_id: int, budget_s: float | None = None) -> bool:
        """Revoke a lease (and delete its keys). False when it was already gone."""
        try:
            self._call(lambda: self._raw.revoke_lease(lease_id), f"revoke lease {lease_id:x}",
                       budget_s)
            return True
        except LeaseNotFound:
            return False

    def lease_since_keepalive(self, lease_id: int) -> int | None:
        """Whole seconds since ``lease_id`` was last kept alive (granted TTL minus the TTL
        left, as etcd counts them: to the second), or None when the lease is gone.

        etcd also restores every lease to its full TTL when a new etcd leader takes over,
        so just after an election this reads 0 for every lease."""
        info = self._call(lambda: self._raw.get_lease_info(lease_id),
                          f"lease {lease_id:x} ttl")
        if info.TTL < 0:
            return None
        return max(0, int(info.grantedTTL) - int(info.TTL))

    def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL in seconds; -1 when the lease does not exist."""
        return self._call(lambda: self._raw.get_lease_info(lease_id).TTL, f"lease {lease_id:x} ttl")

    # -- watches -----------------------------------------------------------------------------------

    def watch_prefix(
        self,
        prefix: str,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        start_revision: int,
    ) -> int:
        """Start a raw watch; returns its id. Use :class:`peer_elastic.etcd.watch.PrefixWatch`.

        ``on_events(events, header_revision)`` runs in the client's watch thread; ``on_error``
        gets a mapped exception once, after which this watch is dead and must be re-created.
        """

        def callback(resp: Any) -> None:
            # The client calls back with None when it closed the stream itself (it does so
            # whenever any request fails over to another endpoint): the watch is dead too.
            if resp is None or isinstance(resp, BaseException):
                if resp is None:
                    err: Exception = EtcdUnavailable(f"watch {prefix}: stream closed")
                elif is_transient(resp):
                    err = EtcdUnavailable(f"watch {prefix}: stream lost: {rpc_details(resp)}")
                else:
                    err = map_error(resp, f"watch {prefix}")
                on_error(err)
                return
            self._disruptions.note_header(resp.header)
            events = []
            for ev in resp.events:
                kind = "put" if isinstance(ev, etcd3.events.PutEvent) else "delete"
                events.append(WatchEvent(kind, KeyValue.from_pb(ev._event.kv)))
            on_events(events, resp.header.revision)

        def do() -> int:
            with self._closing:  # close() waits for a creation under way (bounded: timeout_s)
                if self._closed:
                    raise ClientClosed(f"watch {prefix}: the etcd client was closed")
                watch_id = self._raw.add_watch_prefix_callback(
                    prefix, callback, start_revision=start_revision, progress_notify=True
                )
                self._watch_threads.note(self._raw.watcher)
                return watch_id

        return self._call(do, f"watch {prefix}", budget_s=self.timeout_s * 2)

    @property
    def watch_threads(self) -> list[threading.Thread]:
        """The threads that ran this client's watch streams and still run."""
        return self._watch_threads.alive()

    def cancel_watch(self, watch_id: int) -> None:
        try:
            self._raw.cancel_watch(watch_id)
        except Exception as exc:  # the stream may already be gone; nothing to cancel
            log.debug("cancel watch %s: %s", watch_id, exc)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close the connections; wait at most ``wait_s`` for the threads of the watch
        streams to end (closing cancels their streams), so that none is still running
        when the process exits (peer_elastic.process.threads says why that matters)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        try:
            self._raw.close()
        except Exception as exc:
            log.debug("closing etcd client: %s", exc)
        if left := threads.join_all(self.watch_threads, wait_s):
            log.warning("etcd watch threads still running %.0f s after the client closed: %s",
                        wait_s, ", ".join(t.name for t in left))

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_plaintext_warned: set[str] = set()
_plaintext_lock = threading.Lock()


def _warn_plaintext_password(endpoints: str) -> None:
    """Warn once per process and endpoint list: it is allowed (etcd's own clients do it),
    but the operator should know what it costs."""
    with _plaintext_lock:
        if endpoints in _plaintext_warned:
            return
        _plaintext_warned.add(endpoints)
    log.warning(
        "etcd password auth over plaintext (%s): the password and the auth token cross the "
        "network unencrypted, so anyone who can see the traffic can act as this etcd user. "
        "Use TLS: set %s (the CA of etcd's server certificate) so every endpoint is https; "
        "see docs/security.md", endpoints, CA_VAR)


def client_from_env(endpoints: str | None = None, **kwargs: Any) -> EtcdClient:
    """A client for ``endpoints`` (default ``PEER_ELASTIC_ETCD``) with TLS and auth from
    ``PEER_ELASTIC_ETCD_CA`` / ``_CERT`` / ``_KEY`` and ``PEER_ELASTIC_ETCD_USER`` /
    ``_PASSWORD``: what every peer and every CLI command uses."""
    endpoints = endpoints or settings_table.ETCD.raw()
    if not endpoints:
        raise EtcdError(f"no etcd endpoints: pass them or set {ENV_ENDPOINTS}")
    ca = settings_table.ETCD_CA.raw()
    cert = settings_table.ETCD_CERT.raw()
    key = settings_table.ETCD_KEY.raw()
    if ca is None and (cert or key):
        # Without a CA there is no TLS at all: the certificate would be silently unused and
        # the connection plaintext.
        raise ConfigError(f"{CERT_VAR if cert else KEY_VAR} is set but {CA_VAR} is not: a "
                          f"client certificate is only used over TLS, which needs {CA_VAR} "
                          "(the CA that signed etcd's certificate)")
    return EtcdClient(endpoints, tls=TLSConfig(ca, cert, key) if ca else None,
                      user=settings_table.ETCD_USER.raw(),
                      password=settings_table.ETCD_PASSWORD.raw(), **kwargs)
