"""The end of a run: the one writer of ``<run>/done``, and what a done record means.

Every rank records ``done`` when its training function returns, and the leader records a
failed run (reset limit, elastic timeout); all of them go through :func:`write_done`:
create-if-absent, so the first record stays, and a create retried after its answer was
lost is recognised as our own write (same bytes: the record carries a time stamp and the
writer's member id). :func:`done_error` turns a record into the error a peer ends with.
"""

from __future__ import annotations

import logging
import time

from peer_elastic.errors import (
    ElasticTimeout,
    EtcdUnavailable,
    JobFinished,
    LeaseNotFound,
    PeerElasticError,
    ResetLimitExceeded,
)
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.records import DoneCause, DoneRecord, encode

log = logging.getLogger(__name__)

#: How long :meth:`Coordinator.finish` keeps trying to record the end of the run while
#: etcd does not answer, before it gives up with a clear error.
FINISH_TIMEOUT_S = 120.0


def write_done(client: EtcdClient, keys: RunKeys, run_lease: int, rec: DoneRecord,
               timeout_s: float | None = None) -> bool:
    """Record ``rec`` under ``keys.done`` unless a record is there; True if this call did.

    While etcd does not answer it keeps trying for ``timeout_s`` (None: the client's own
    retry budget only), then raises :class:`EtcdUnavailable`: a run whose end is not recorded
    would be trained again by the next peer to start. A gone run lease is a
    :class:`PeerElasticError`: nothing can be recorded under it any more.
    """
    data = encode(rec)
    deadline = time.monotonic() + (timeout_s or 0.0)
    while True:
        try:
            created, existing = client.create(keys.done, data, run_lease)
            break
        except LeaseNotFound:
            raise PeerElasticError(
                f"job {keys.job!r}: the end of run {keys.run_id} cannot be recorded: its "
                "lease is gone (no peer kept it alive for run_ttl_s)") from None
        except EtcdUnavailable as exc:
            if time.monotonic() >= deadline:
                if timeout_s is None:
                    raise
                raise EtcdUnavailable(
                    f"job {keys.job!r}: could not record that run {keys.run_id} finished: "
                    f"etcd did not answer for {timeout_s:.0f} s ({exc}). Until it is "
                    "recorded, a peer that starts would train the job again.") from None
            log.warning("recording the end of the run: %s; retrying", exc)
            time.sleep(0.2)
    # Ours also when the client retried a create whose answer was lost: same bytes.
    return created or (existing is not None and existing.value == data)


def done_error(job: str, done: DoneRecord) -> PeerElasticError:
    """The error a peer of ``job`` ends with once the run is ``done``."""
    cause = done.cause or _legacy_cause(done)
    if not done.success and cause == DoneCause.DONE_CAUSE_RESET_LIMIT:
        return ResetLimitExceeded(f"job {job!r} failed: {done.reason}")
    if not done.success and cause == DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT:
        return ElasticTimeout(f"job {job!r} failed: {done.reason}")
    return JobFinished(
        f"job {job!r} already finished "
        + ("successfully" if done.success else f"with failure: {done.reason}"),
        done.success,
        done.reason,
    )


def _legacy_cause(done: DoneRecord) -> int:
    """The cause of a record written before ``DoneRecord.cause`` existed: such writers
    began the reason of the two failures a peer tells apart with these words."""
    if done.reason.startswith("reset limit"):
        return DoneCause.DONE_CAUSE_RESET_LIMIT
    if done.reason.startswith("elastic timeout"):
        return DoneCause.DONE_CAUSE_ELASTIC_TIMEOUT
    return DoneCause.DONE_CAUSE_UNSPECIFIED
