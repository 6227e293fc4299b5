"""Requests about many leases at once, for a process that keeps hundreds alive:
:class:`LeaseStreams`, used by :class:`~peer_elastic.etcd.client.EtcdClient`.

One keep-alive stream carries a request per lease (one round trip for all of them), and
TimeToLive requests go out side by side. A process with hundreds of members pays one round
trip per refresh round, and per confirmation of the leases a round found gone, instead of
one per lease.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import etcd3.exceptions as etcd_exc
import grpc
from etcd3 import etcdrpc

#: Runs a request with the client's retries and typed errors: (fn, what, budget_s) -> result.
Call = Callable[[Callable[[], Any], str, "float | None"], Any]


class LeaseStreams:
    """Keep-alive and TimeToLive requests for many leases, over a client's channel.

    ``raw`` is the client's ``etcd3`` client, ``call`` its retried call, ``note_header``
    what it learns from a response header (etcd's leader changes).
    """

    def __init__(self, raw: Any, timeout_s: float, call: Call,
                 note_header: Callable[[Any], None]) -> None:
        self._raw = raw
        self.timeout_s = timeout_s
        self._call = call
        self._note_header = note_header

    def keepalive_many(self, lease_ids: Sequence[int],
                       budget_s: float | None = None) -> dict[int, int]:
        """Keep several leases alive over one stream (one round trip for all of them).

        Returns lease id -> TTL etcd answered; a TTL of 0 means etcd no longer knows the
        lease, which the caller confirms (:meth:`lease_ttls`) before believing it (see
        ``EtcdClient.keepalive``). One request per lease: a process that keeps hundreds of member leases alive
        pays one stream per refresh round instead of one per lease.

        A stream cut short (its deadline passed on a starved process, the connection
        dropped) still counts for the leases etcd answered before that: each answer is a
        refresh etcd applied. Those are returned and the others are left out, for the
        caller to try again; only a stream that brought no answer at all raises (and is
        retried within ``budget_s``). Retrying every lease because the last answers were
        late would let all of them expire together on a host that stays slow.
        """
        ids = list(dict.fromkeys(lease_ids))

        def ask() -> tuple[dict[int, int], Any]:
            reqs = [etcdrpc.LeaseKeepAliveRequest(ID=i) for i in ids]
            out: dict[int, int] = {}
            stream = self._raw.leasestub.LeaseKeepAlive(
                iter(reqs), self.timeout_s, credentials=self._raw.call_credentials,
                metadata=self._raw.metadata)
            # Read to the stream's end rather than cancel it once every answer is in: the
            # request iterator is finite, so etcd ends the stream right after the last
            # answer, and by then gRPC's thread sending the requests has finished. A
            # cancelled stream leaves that thread winding down, maybe into the process's
            # exit (peer_elastic.process.threads says why that must not happen).
            header = None
            try:
                for resp in stream:
                    out[resp.ID] = resp.TTL
                    header = resp.header
            except grpc.RpcError:
                if not out:
                    raise
                # answered ones were refreshed; the rest go back to the caller
            if not out:
                raise etcd_exc.ConnectionFailedError()  # stream ended without an answer
            return out, header

        return self._answers(ids, ask, f"keep {len(ids)} leases alive", budget_s)

    def lease_ttls(self, lease_ids: Sequence[int],
                   budget_s: float | None = None) -> dict[int, int]:
        """Seconds left on each of several leases, -1 for one etcd does not know.

        The TimeToLive requests go out side by side and their answers are read together:
        one round trip for all of them, however many. A process that confirms hundreds of
        lost member leases one by one spends seconds on it, on the thread that must also
        refresh the leases its members just rejoined with. Leases whose request failed
        are left out, for the caller to ask again; only a call with no answer at all raises
        (and is retried within ``budget_s``).
        """
        ids = list(dict.fromkeys(lease_ids))

        def ask() -> tuple[dict[int, int], Any]:
            futures = {i: self._raw.leasestub.LeaseTimeToLive.future(
                etcdrpc.LeaseTimeToLiveRequest(ID=i), self.timeout_s,
                credentials=self._raw.call_credentials, metadata=self._raw.metadata)
                for i in ids}
            out: dict[int, int] = {}
            failure: grpc.RpcError | None = None
            header = None
            for lease_id, future in futures.items():
                try:
                    resp = future.result()
                except grpc.RpcError as exc:
                    failure = exc
                    continue
                out[lease_id] = resp.TTL
                header = resp.header
            if failure is not None and not out:
                raise failure
            return out, header

        return self._answers(ids, ask, f"ask the TTL of {len(ids)} leases", budget_s)

    def _answers(self, ids: list[int], ask: Callable[[], tuple[dict[int, int], Any]],
                 what: str, budget_s: float | None) -> dict[int, int]:
        """``ask()`` (one request about all of ``ids``: the answers by lease and the last
        response header) through the retried call, the header noted; nothing to ask for no
        lease."""
        if not ids:
            return {}

        def do() -> dict[int, int]:
            out, header = ask()
            if header is not None:
                self._note_header(header)
            return out

        return self._call(do, what, budget_s)
