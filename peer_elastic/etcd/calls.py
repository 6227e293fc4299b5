"""One etcd request, retried: which failures are transient, how long they are retried, and
the typed error a caller gets when they do not pass.

* transient failures (an endpoint down, a leader election, "no server available") are
  retried with bounded exponential backoff, within a budget; past it the error names the
  endpoints and how long it tried (:class:`~peer_elastic.errors.EtcdUnavailable`), or the
  certificate problem that made every handshake fail (:class:`~peer_elastic.errors.EtcdTLSError`);
* raw ``grpc.RpcError`` objects are mapped onto :mod:`peer_elastic.errors` types
  (:func:`map_error`);
* an expired auth token is renewed and the request tried again.

:class:`RetriedCalls` runs the requests of one :class:`~peer_elastic.etcd.client.EtcdClient`.
With ``client.py``, this is the only module that imports ``etcd3`` or ``grpc``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import etcd3.exceptions as etcd_exc
import grpc
import tenacity

from peer_elastic.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdRequestTooLarge,
    EtcdTLSError,
    EtcdUnavailable,
    LeaseNotFound,
    RevisionCompacted,
)
from peer_elastic.etcd.tls import certificate_problem, connection_hint

__all__ = ["TLS_RETRY_S", "DisruptionClock", "FaultInjection", "RetriedCalls", "is_transient", "map_error",
           "rpc_details"]

T = TypeVar("T")

#: How long a TLS handshake refused over certificates is retried (failover to the other
#: endpoints takes well under this) before the call fails with :class:`EtcdTLSError`.
TLS_RETRY_S = 2.0

_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
}
_TRANSIENT_CLIENT_ERRORS = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    etcd_exc.WatchTimedOut,
)


def rpc_details(exc: BaseException) -> str:
    try:
        return str(exc.details())  # type: ignore[attr-defined]
    except Exception:
        return str(exc)


def _root_details(exc: BaseException) -> str:
    """What went wrong, from the gRPC error behind ``exc`` where there is one: the etcd3
    client wraps a failed connection in a bare ``ConnectionFailedError`` whose own text says
    nothing (the cause says "Connection refused", or why a TLS handshake failed)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, grpc.RpcError):
            return rpc_details(cur)
        cur = cur.__cause__ or cur.__context__
    return str(exc) or type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """True for failures that another attempt, perhaps on another endpoint, may not see."""
    if isinstance(exc, _TRANSIENT_CLIENT_ERRORS):
        return True
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True  # etcd3 refuses an endpoint it marked failed; time_retry is short
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        if code in _TRANSIENT_CODES:
            return True
        details = rpc_details(exc)
        # etcd answers these during elections and overload; a retry succeeds.
        return any(s in details for s in ("leader changed", "no leader", "too many requests",
                                          "timed out"))
    return False


def _is_token_expired(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and "invalid auth token" in rpc_details(exc)


def map_error(exc: BaseException, what: str) -> Exception:
    """Turn a client or gRPC error into a peer-elastic error that says what failed."""
    if isinstance(exc, EtcdError):
        return exc
    if isinstance(exc, etcd_exc.RevisionCompactedError):
        return RevisionCompacted(exc.compacted_revision)
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        details = rpc_details(exc)
        if "lease not found" in details:
            return LeaseNotFound(f"{what}: {details}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and any(s in details for s in ("user name", "authentication", "auth", "permission"))
        ):
            return EtcdAuthError(f"{what}: etcd refused the credentials: {details}")
        if "Received message larger than max" in details:
            return EtcdRequestTooLarge(
                f"{what}: etcd's answer is larger than the client accepts ({details})")
        if "too large" in details or "larger than max" in details:
            return EtcdRequestTooLarge(f"{what}: request too large for etcd ({details})")
        if "space exceeded" in details:
            return EtcdError(
                f"{what}: etcd is out of space ({details}); compact and defragment it, or "
                "raise --quota-backend-bytes"
            )
        return EtcdError(f"{what}: {code.name if code else 'error'}: {details}")
    return EtcdError(f"{what}: {type(exc).__name__}: {exc}")


@dataclass
class FaultInjection:
    """Test hook of :class:`EtcdClient` (``client.faults = FaultInjection(...)``).

    ``before(what)`` runs before every attempt of a request (``what`` names it, e.g.
    ``"transaction on /peer-elastic/job/run"``); it may block or raise. ``lose_response(what)``
    runs after an attempt that etcd answered: when it returns True the answer is dropped and
    the attempt fails with a transient error, exactly as when a connection breaks after etcd
    applied a write (an *ambiguous* failure). The client then retries as it always does,
    which is what makes non-idempotent writes dangerous and what the tests provoke.
    """

    before: Callable[[str], None] | None = None
    lose_response: Callable[[str], bool] | None = None


class DisruptionClock:
    """When etcd was last seen disrupted (``time.monotonic()``, 0: never): a transient
    failure of one of a client's requests, or a new raft term (a leader election) in a
    response header. While etcd is disrupted, other members' requests may stall for a full
    timeout."""

    def __init__(self) -> None:
        self.at = 0.0
        self._raft_term = 0

    def transient_failure(self) -> None:
        self.at = time.monotonic()

    def note_header(self, header: object) -> None:
        """Track the raft term of responses: a change means etcd elected a new leader."""
        term = getattr(header, "raft_term", 0)
        if term and term != self._raft_term:
            if self._raft_term:
                self.at = time.monotonic()
            self._raft_term = term


class _Retry(Exception):
    """Internal: the auth token was renewed, try the call again."""


class RetriedCalls:
    """How one client runs its requests; see the module docstring.

    ``describe()`` names the client's endpoints (for errors), ``secure`` says whether they
    speak TLS (for hints), ``on_transient()`` is told of every transient failure (the
    client's disruption clock), ``renew_auth()`` renews an expired token (None: no auth).
    ``faults`` is read at every attempt.
    """

    def __init__(self, describe: Callable[[], str], secure: bool,
                 on_transient: Callable[[], None],
                 renew_auth: Callable[[], None] | None = None) -> None:
        self._describe = describe
        self._secure = secure
        self._on_transient = on_transient
        self._renew_auth = renew_auth
        self.faults: FaultInjection | None = None  # tests only; see FaultInjection

    def run(self, fn: Callable[[], T], what: str, budget_s: float) -> T:
        """Run ``fn`` with retries on transient errors for ``budget_s``; map every failure
        to our types."""
        started = time.monotonic()
        last: list[BaseException] = []

        def attempt() -> T:
            try:
                faults = self.faults
                if faults is not None and faults.before is not None:
                    faults.before(what)
                result = fn()
                if faults is not None and faults.lose_response is not None \
                        and faults.lose_response(what):
                    raise etcd_exc.ConnectionTimeoutError(f"injected: the answer to {what} was lost")
                return result
            except BaseException as exc:
                last[:] = [exc]
                if is_transient(exc):
                    self._on_transient()
                if _is_token_expired(exc) and self._renew_auth is not None:
                    self._renew_auth()
                    raise _Retry() from exc
                raise

        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, _Retry):
                return True
            if not is_transient(exc):
                return False
            # A certificate verdict repeats on every attempt: retry only long enough for
            # failover to reach the other endpoints (one of them may hold a good certificate).
            return (certificate_problem(_root_details(exc)) is None
                    or time.monotonic() - started < min(budget_s, TLS_RETRY_S))

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(budget_s),
            wait=tenacity.wait_exponential(multiplier=0.05, max=1.0) + tenacity.wait_random(0, 0.05),
            retry=tenacity.retry_if_exception(retryable),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except _Retry:
            raise EtcdAuthError(f"{what}: could not renew the etcd auth token") from None
        except BaseException as exc:
            if is_transient(exc):
                raise self._gave_up(what, _root_details(last[0] if last else exc),
                                    time.monotonic() - started) from None
            raise map_error(exc, what) from None

    def _gave_up(self, what: str, detail: str, waited: float) -> EtcdError:
        """The error of a request whose transient failures outlasted its budget."""
        problem = certificate_problem(detail)
        if problem is not None:
            return EtcdTLSError(f"{what}: TLS handshake with etcd ({self._describe()}) failed: "
                                f"{problem} (gRPC: {detail})")
        return EtcdUnavailable(
            f"{what}: no etcd endpoint answered ({self._describe()}) "
            f"within {waited:.1f} s; last error: {detail}"
            f"{connection_hint(detail, self._secure)}"
        )
