"""Exception types of peer-elastic.

Everything the framework raises on purpose derives from :class:`PeerElasticError`, so a
caller can catch one type. Raw gRPC errors from the etcd client never escape the adapter
(:mod:`peer_elastic.etcd.client`); they are mapped onto the types below.
"""

from __future__ import annotations


class PeerElasticError(Exception):
    """Base of every error peer-elastic raises on purpose."""


# --- etcd access -------------------------------------------------------------------------


class EtcdError(PeerElasticError):
    """An etcd request failed for a reason that retrying will not fix."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered within the retry budget.

    The message names the endpoints tried and for how long, so the operator can act.
    """


class EtcdRequestTooLarge(EtcdError):
    """etcd refused a request over its size limit (``--max-request-bytes``, 1.5 MiB)."""


class EtcdAuthError(EtcdError):
    """etcd refused the credentials (user/password or client certificate)."""


class EtcdTLSError(EtcdAuthError):
    """A TLS handshake with etcd failed over certificates: another attempt will fail the same
    way. The message says which setting to fix (CA, client certificate, key)."""


class LeaseNotFound(EtcdError):
    """The lease used for a request no longer exists (expired or revoked)."""


class RevisionCompacted(EtcdError):
    """A watch asked for a revision etcd has already compacted away."""

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"revision compacted below {compacted_revision}")
        self.compacted_revision = compacted_revision


class ClientClosed(EtcdError):
    """A request on an etcd client that was closed: nothing will answer it, ever (a watch
    on it ends instead of retrying)."""


# --- job and coordination -------------------------------------------------------------------


class ConfigError(PeerElasticError):
    """Settings are invalid, or differ from the settings the running job was started with."""


class JobNotFound(ConfigError):
    """The job has no running run in etcd: never started, or ended more than ``run_ttl_s``
    ago (or its name is misspelt)."""


class RecordError(PeerElasticError):
    """A value read from etcd is not a valid peer-elastic record."""


class LeaseLost(PeerElasticError):
    """This peer's lease expired or was revoked; it is no longer a member."""


class LeaveRequested(PeerElasticError):
    """This peer was asked to leave (SIGTERM, drain) and the job has formed without it."""


class ElasticTimeout(PeerElasticError):
    """Fewer than ``min_np`` peers were available for longer than the elastic timeout."""


class ResetLimitExceeded(PeerElasticError):
    """The job reset more often than ``reset_limit`` allows."""


class ShardedStateLost(PeerElasticError):
    """A group holds shards of trained sharded state but not every shard of any version,
    and no durable snapshot loaded: more peers died at once than the redundancy covers."""


class JobFinished(PeerElasticError):
    """The job's run already ended (its ``done`` record exists).

    ``success`` tells whether it ended well; a peer that sees this exits 0 when it did.
    """

    def __init__(self, message: str, success: bool, reason: str = "") -> None:
        super().__init__(message)
        self.success = success
        self.reason = reason


# --- training loop (Horovod Elastic semantics) ------------------------------------------------


class HostsUpdatedInterrupt(PeerElasticError):
    """Membership changed: every roster member raises this at the same ``check_host_updates``.

    ``skip_sync`` is true when the change only removed peers (shown in the log). Whether the
    state is synced after the reset is not decided here: the new group compares the versions
    its ranks hold and skips the sync only when they are all the same.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated" + (" (removals only)" if skip_sync else ""))
        self.skip_sync = skip_sync


# There is no counterpart of Horovod's HorovodInternalError: a failed collective surfaces as
# torch's own error (RuntimeError, DistError) inside the training function, and the run loop
# (peer_elastic.elastic.Peer) recognises it, restores the last commit and re-forms. User code
# never needs to catch one, so none is exported.
