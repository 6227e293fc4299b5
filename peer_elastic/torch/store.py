"""A ``torch.distributed.Store`` over etcd v3, for one generation's rendezvous.

Why not torch's own stores: ``TCPStore`` needs one process to host the server, and in a
job with no central driver any peer may vanish, taking the rendezvous with it. torch's
``EtcdStore`` speaks the etcd v2 API (off by default since etcd 3.4, removed in 3.6) and
polls. This store keeps the rendezvous in the etcd the peers already share, under a
per-generation key prefix attached to the run lease, so keys of an abandoned generation
cannot confuse a later one and all of them disappear with the run.

What torch 2.13 calls on a Python store (checked against the pybind trampoline, which
looks methods up by these names)::

    set(key, value: bytes)                       get(key) -> bytes (blocks)
    add(key, n) -> int                           check(keys) -> bool
    wait(keys) / wait(keys, timeout)             compare_set(key, expected, desired) -> bytes
    deleteKey(key) -> bool  (C++ name)           getNumKeys() -> int  (C++ name)
    multi_get(keys) / multi_set(keys, values)    append(key, value)
    has_extended_api() -> bool                   clone() -> Store (pure virtual in C++)

(``delete_key``/``num_keys`` exist too, for Python callers. ``list_keys`` and the queue
methods are not forwarded to Python subclasses at all.)

``set_timeout``/``timeout`` are the C++ base class's own and are not forwarded; this store
reads the base's ``timeout`` so the two can never disagree. A gloo rendezvous (both
``init_process_group`` and ``new_group``) only does, per rank: ``set`` of its own address,
then ``wait([peer])`` + ``get(peer)`` for every rank, with ``wait``'s timeout being the
process group timeout.

Blocking waits read the keys once and then watch them from the revision of that read (no
polling, no gap). They call ``abort()`` before that read and every ``abort_poll_s`` seconds
while blocked; when it returns a reason the wait raises :class:`StoreAborted` at once, so a
rendezvous whose generation was superseded, or whose peer died, is abandoned instead of
running into the timeout. Values are the raw bytes torch hands over; nothing is unpickled.

Lifetime: torch holds only the C++ half of a Python store, so each store keeps itself
referenced until :meth:`EtcdStore.close` (otherwise ``new_group`` after the caller dropped
its reference fails inside torch with "Not implemented").
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from peer_elastic.errors import EtcdUnavailable, PeerElasticError, RevisionCompacted
from peer_elastic.etcd.client import EtcdClient, KeyValue, Txn, WatchEvent

log = logging.getLogger(__name__)

__all__ = ["EtcdStore", "StoreAborted", "StoreTimeout"]

AbortFn = Callable[[], str | None]

#: Sub-prefix of the exactly-once markers of add/append (see ``EtcdStore._cas_once``). The
#: NUL keeps it apart from torch's key names; ``num_keys`` does not count these.
_MARKER = "\x00applied/"


class StoreTimeout(dist.DistStoreError, PeerElasticError):
    """Keys did not appear within the timeout.

    A ``DistStoreError`` like the timeouts of torch's native stores (TCPStore, HashStore),
    so torch and callers that handle those handle this one too.
    """


class StoreAborted(dist.DistStoreError, PeerElasticError):
    """``abort()`` gave a reason while the store was waiting; the message is that reason.

    In torch 2.13 the type survives the trip through gloo's C++ rendezvous (pybind re-raises
    the original Python exception from ``init_process_group``; the tests check it). Code
    that must not depend on that can read :attr:`EtcdStore.abort_reason` instead.
    """


def _to_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """torch hands over ``bytes``; Python callers may pass ``str`` (as with torch's stores)."""
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


def _seconds(timeout: timedelta | float | None) -> float:
    if timeout is None:
        return 0.0
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class _Waiter:
    """Which of some keys exist, kept current by one watch; woken on every change.

    Filled from a read at revision R and then from watch events after R, in revision
    order (the client delivers one watch's events in order), so ``values`` is always
    what etcd held at some revision.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = set(keys)
        self.values: dict[str, bytes] = {}
        self.error: Exception | None = None
        self.cond = threading.Condition()

    def snapshot(self, kvs: Iterable[KeyValue]) -> None:
        with self.cond:
            self.values = {kv.key: kv.value for kv in kvs if kv.key in self.keys}

    def on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self.cond:
            for ev in events:
                if ev.kv.key not in self.keys:
                    continue  # a longer key under the same prefix
                if ev.kind == "put":
                    self.values[ev.kv.key] = ev.kv.value
                else:
                    self.values.pop(ev.kv.key, None)
            self.cond.notify_all()

    def on_error(self, exc: Exception) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify_all()

    def complete(self) -> bool:
        return len(self.values) == len(self.keys)


_ALIVE: set[EtcdStore] = set()  # see EtcdStore.close
_ALIVE_LOCK = threading.Lock()


class EtcdStore(dist.Store):
    """torch ``Store`` whose keys are ``prefix + key`` in etcd v3; see the module docstring.

    ``lease_id`` (the run lease) is attached to every key written, so the keys go away with
    the run. ``timeout`` is the default for blocking calls (``get``, ``wait`` without a
    timeout, ``multi_get``); a zero timeout waits forever, as in torch's stores. Thread-safe:
    the only shared state is the (thread-safe) client. Call :meth:`close` after destroying
    the process groups formed over it (see there for why it is kept alive until then).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease_id: int | None = None,
        timeout: timedelta = timedelta(seconds=60),
        abort: AbortFn | None = None,
        *,
        abort_poll_s: float = 0.1,
        on_value: Callable[[str, bytes], None] | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self.prefix = prefix
        self.lease_id = lease_id
        self._abort = abort
        self.abort_poll_s = abort_poll_s
        # Sees each (key, value) written or read through this store and its clones: the
        # records gloo's groups exchange as they form, subgroups' included.
        self._on_value = on_value
        self.abort_reason: str | None = None  # the reason of the last StoreAborted raised
        # Markers of add/append calls that returned: deleted by the next such write.
        self._spent_markers: list[str] = []
        self._markers_lock = threading.Lock()
        self.set_timeout(timeout)
        with _ALIVE_LOCK:
            _ALIVE.add(self)

    def close(self) -> None:
        """Let this store be garbage-collected; call once torch no longer uses it.

        torch keeps only the C++ half of a Python store alive (``PrefixStore`` and the
        process group hold a C++ pointer): if the Python object were collected, torch's
        next call through that pointer (``new_group``, a store-based barrier) would fail
        with "INTERNAL ASSERT FAILED ... Not implemented". So every store registers itself
        in a module-level set at construction and stays there until ``close()``, which is
        only safe after ``destroy_process_group`` of every group formed over it. Forgetting
        ``close()`` costs a few hundred bytes per store, nothing else (no watch or thread
        outlives a call). Idempotent; waiting on a closed store still works.
        """
        with _ALIVE_LOCK:
            _ALIVE.discard(self)

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore(prefix={self.prefix!r}, lease={self.lease_id})"

    # -- plumbing ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _check_abort(self) -> None:
        if self._abort is None:
            return
        reason = self._abort()
        if reason is not None:
            self.abort_reason = reason
            raise StoreAborted(f"EtcdStore {self.prefix}: rendezvous abandoned: {reason}")

    def _wait_values(
        self, keys: Sequence[str], timeout: timedelta | float | None = None
    ) -> dict[str, bytes]:
        """Block until every (full etcd) key exists; return the values seen.

        One read of the keys' common prefix; if something is missing, a watch from the
        revision of that read, so nothing set in between is missed. A watch that dies
        (stream lost, failover, compaction) is replaced by a fresh read and watch.
        """
        if not keys:
            return {}
        limit_s = _seconds(self.timeout if timeout is None else timeout)
        deadline = None if limit_s <= 0 else time.monotonic() + limit_s
        self._check_abort()
        waiter = _Waiter(keys)
        common = os.path.commonprefix(list(waiter.keys))
        backoff = 0.05
        while True:
            try:
                kvs, revision = self._client.get_prefix(common)
                waiter.snapshot(kvs)
                if waiter.complete():
                    return dict(waiter.values)
                waiter.error = None
                watch_id = self._client.watch_prefix(
                    common, waiter.on_events, waiter.on_error, start_revision=revision + 1
                )
            except RevisionCompacted:
                continue  # compacted between the read and the watch: read again
            except EtcdUnavailable as exc:
                # The wait is bounded by its timeout, not by the client's retry budget.
                err: Exception | None = exc
            else:
                try:
                    err = self._block(waiter, deadline, limit_s)
                finally:
                    self._client.cancel_watch(watch_id)
                if err is None:
                    return dict(waiter.values)
            # The watch died (stream lost, failover, compaction) or etcd did not answer:
            # read again, watch again.
            log.info("EtcdStore %s: %s; reading again", self.prefix, err)
            if deadline is not None and time.monotonic() >= deadline:
                raise StoreTimeout(
                    f"EtcdStore {self.prefix}: timed out after {limit_s:.1f} s waiting for "
                    f"keys {self._missing(waiter)}; last etcd error: {err}"
                ) from err
            time.sleep(backoff if deadline is None
                       else max(0.0, min(backoff, deadline - time.monotonic())))
            backoff = min(1.0, backoff * 2)
            self._check_abort()

    def _missing(self, waiter: _Waiter) -> list[str]:
        with waiter.cond:
            return sorted(k[len(self.prefix):] for k in waiter.keys - waiter.values.keys())

    def _block(self, waiter: _Waiter, deadline: float | None, limit_s: float) -> Exception | None:
        """Sleep on the watch until the keys exist (None) or it fails (its error).

        Wakes at least every ``abort_poll_s`` to ask ``abort()``, which is called without
        any lock held since it may take its own.
        """
        while True:
            pause = self.abort_poll_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = self._missing(waiter)
                    if missing:
                        raise StoreTimeout(
                            f"EtcdStore {self.prefix}: timed out after {limit_s:.1f} s "
                            f"waiting for keys {missing}"
                        )
                pause = max(0.0, min(pause, left))
            with waiter.cond:
                if not waiter.complete() and waiter.error is None:
                    waiter.cond.wait(pause)
                if waiter.complete():
                    return None
                if waiter.error is not None:
                    return waiter.error
            self._check_abort()

    def _read(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Current values of some full keys in one round trip (one txn of range reads)."""
        if len(keys) == 1:
            return [self._client.get(keys[0])]
        _, responses = self._client.txn([], [Txn.get(k) for k in keys])
        return [r[0] if r else None for r in responses]

    # -- the Store API -------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under the run lease (overwrites, like torch's stores)."""
        data = _to_bytes(value)
        self._client.put(self._key(key), data, lease=self.lease_id)
        self._saw(key, data)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        full = self._key(key)
        value = self._wait_values([full])[full]
        self._saw(key, value)
        return value

    def _saw(self, key: str, value: bytes) -> None:
        if self._on_value is None:
            return
        try:
            self._on_value(key, value)
        except Exception:  # an observer: its failure must not fail torch's rendezvous
            log.exception("EtcdStore %s: the on_value hook failed on %r", self.prefix, key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until all ``keys`` exist; ``timeout`` defaults to the store's."""
        if keys:
            self._wait_values([self._key(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        """True iff all ``keys`` exist right now (never waits)."""
        if not keys:
            return True
        return all(kv is not None for kv in self._read([self._key(k) for k in keys]))

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the decimal counter at ``key`` (missing = 0).

        A compare-and-swap loop on the key's mod revision: one round trip per attempt, and
        an attempt only fails when another peer changed the key in between. Exactly once
        even when etcd applied an attempt whose answer was lost and the client retried it:
        see :meth:`_cas_once`.
        """
        full = self._key(key)
        amount = int(value)
        kv = self._client.get(full)
        mark = self._new_marker()
        while True:
            if kv is None:
                guard, new = Txn.version(full) == 0, amount
            else:
                try:
                    current = int(kv.value)
                except ValueError:
                    raise dist.DistStoreError(
                        f"EtcdStore {self.prefix}: add({key!r}): value {kv.value[:40]!r} "
                        "is not a decimal integer"
                    ) from None
                if amount == 0:
                    return current  # a read: torch's barriers poll counters with add(k, 0)
                guard, new = Txn.mod(full) == kv.mod_revision, current + amount
            encoded = str(new).encode()
            done, kv = self._cas_once(full, guard, encoded, mark, encoded)
            if done is not None:
                return int(done)

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set ``key`` to ``desired_value`` iff it holds ``expected_value``; torch semantics.

        As torch's HashStore/TCPStore: an empty ``expected_value`` also matches a missing
        key. Returns the value the key holds afterwards, except that for a missing key and
        a non-empty ``expected_value`` it returns ``expected_value`` (torch does the same).
        """
        full = self._key(key)
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        put = Txn.put(full, desired, self.lease_id)
        while True:
            # etcd fails a value compare on a missing key, hence the version compare.
            guard = Txn.version(full) == 0 if not expected else Txn.value(full) == expected
            ok, resp = self._client.txn([guard], [put], [Txn.get(full)])
            if ok:
                return desired
            kv = resp[0][0] if resp and resp[0] else None
            if kv is None:
                if expected:
                    return expected
                continue  # deleted between the compare and the read: try again
            if not expected and kv.value == b"":
                # An existing empty value also matches an empty expectation.
                if self._client.compare_and_put(full, desired, kv.mod_revision, self.lease_id):
                    return desired
                continue
            return kv.value

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True iff it existed."""
        return self._client.delete(self._key(key)) > 0

    def delete_unless_all_exist(self, key: str, others: Sequence[str]) -> bool:
        """Delete ``key`` unless it and every one of ``others`` exist, atomically; True iff
        it is gone afterwards. Not part of torch's API: the withdrawal of
        :mod:`peer_elastic.torch.barrier`.

        ``key`` is among the compares so that a retry whose first attempt deleted it (and
        lost the answer) still answers True, even if the others all exist by then.
        """
        ok, _ = self._client.txn([Txn.version(self._key(k)) > 0 for k in (key, *others)], [],
                                 [Txn.delete(self._key(key))])
        return not ok

    def num_keys(self) -> int:
        """How many keys this store's prefix holds (its exactly-once markers not counted)."""
        kvs, _ = self._client.get_prefix(self.prefix)
        return sum(1 for kv in kvs if not kv.key.startswith(self.prefix + _MARKER))

    # torch's C++ trampoline calls these two by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Values of all ``keys``, waiting (store timeout) until they all exist."""
        full = [self._key(k) for k in keys]
        if not full:
            return []
        values = self._wait_values(full)
        for key, k in zip(keys, full, strict=True):
            self._saw(key, values[k])
        return [values[k] for k in full]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set several keys in one atomic transaction."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [Txn.put(self._key(k), _to_bytes(v), self.lease_id)
                for k, v in zip(keys, values, strict=True)]
        if puts:
            self._client.txn([], puts)
            for key, value in zip(keys, values, strict=True):
                self._saw(key, _to_bytes(value))

    def append(self, key: str, value: bytes | str) -> None:
        """Atomically append ``value`` to ``key`` (creating it), by compare-and-swap; exactly
        once even across a retried ambiguous failure (see :meth:`_cas_once`)."""
        full = self._key(key)
        data = _to_bytes(value)
        kv = self._client.get(full)
        mark = self._new_marker()
        while True:
            old, rev = (b"", 0) if kv is None else (kv.value, kv.mod_revision)
            guard = Txn.version(full) == 0 if rev == 0 else Txn.mod(full) == rev
            done, kv = self._cas_once(full, guard, old + data, mark, b"")
            if done is not None:
                return

    # -- exactly-once read-modify-write -----------------------------------------------------------

    def _new_marker(self) -> str:
        return f"{self.prefix}{_MARKER}{secrets.token_hex(8)}"

    def _cas_once(self, full: str, guard: object, new: bytes, mark: str, result: bytes,
                  ) -> tuple[bytes | None, KeyValue | None]:
        """One compare-and-swap attempt of ``full`` to ``new`` that is safe to retry.

        The client retries a request whose answer was lost (UNAVAILABLE, DEADLINE_EXCEEDED),
        and etcd may have applied it: the retry's compare then fails against our own write,
        and a plain read-modify-write loop would apply the change a second time. So the
        write also puts ``mark`` (unique to the caller's one call) holding ``result``, and a
        failed compare reads it back: present means an earlier attempt of this call applied.

        Returns (``result``, None) when this call's write is in etcd, or (None, the key's
        current value) to try again from.
        """
        lease = self.lease_id
        with self._markers_lock:
            spent, self._spent_markers = self._spent_markers, []
        try:
            ok, resp = self._client.txn(
                [guard],
                [Txn.put(full, new, lease), Txn.put(mark, result, lease),
                 *[Txn.delete(m) for m in spent]],  # markers of calls already returned
                [Txn.get(full), Txn.get(mark)],
            )
        except BaseException:
            with self._markers_lock:
                self._spent_markers += spent
            raise
        with self._markers_lock:
            self._spent_markers += [mark] if ok else [*spent]
            if not ok and resp[1]:
                self._spent_markers.append(mark)
        if ok:
            return result, None
        if resp[1]:
            return resp[1][0].value, None  # applied before; its answer was lost
        return None, (resp[0][0] if resp[0] else None)

    def has_extended_api(self) -> bool:
        """multi_get, multi_set and append are native here."""
        return True

    def clone(self) -> EtcdStore:
        """Another handle on the same keys (torch clones stores for some sub-groups).

        The clone stays alive until its own :meth:`close` (see there).
        """
        return EtcdStore(
            self._client, self.prefix, self.lease_id, self.timeout, self._abort,
            abort_poll_s=self.abort_poll_s, on_value=self._on_value,
        )

    # -- beyond torch ---------------------------------------------------------------------------

    def delete_all(self) -> int:
        """Remove every key of this store (e.g. once a generation is over); returns how many."""
        return self._client.delete(self.prefix, prefix=True)
