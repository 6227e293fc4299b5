"""Becoming a member of a job's current run, starting the run if there is none.

:func:`register` puts a fresh member key under a fresh member lease, in one transaction
with the run record it read (or created): a member never registers into a run that
changed or ended meanwhile. A peer that lost its lease calls it again and comes back as a
new member (a joiner). The session is revoked on any failure, so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from peer_elastic import __version__
from peer_elastic.config import JobSettings
from peer_elastic.errors import ConfigError, LeaseNotFound, PeerElasticError, RecordError
from peer_elastic.etcd.client import EtcdClient, Txn
from peer_elastic.etcd.done import done_error
from peer_elastic.etcd.keys import JobKeys, RunKeys
from peer_elastic.etcd.lease import LeaseKeeper, Session
from peer_elastic.etcd.writer import holds
from peer_elastic.records import (
    DoneRecord,
    JobConfig,
    MemberRecord,
    RunRecord,
    decode,
    encode,
    valid_name,
)
from peer_elastic.settings_table import HOST

log = logging.getLogger(__name__)

#: Attempts at registering while the run record keeps changing under us.
ATTEMPTS = 20


def default_host() -> str:
    host = HOST.raw() or socket.gethostname() or "localhost"
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in host)[:64]
    return host if valid_name(host) else "host"


@dataclass(frozen=True)
class Identity:
    """What a peer says about itself in every member record it writes."""

    host: str
    address: str = ""
    local_rank: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    net_address: str = ""  # the IP its process groups use (peer_elastic.process.netaddr)
    probe_port: int = 0  # a port on net_address that accepts reachability probes

    @classmethod
    def of_this_process(cls, host: str | None, address: str = "", local_rank: int = 0,
                        labels: Mapping[str, str] | None = None, net_address: str = "",
                        probe_port: int = 0) -> Identity:
        """This process's identity on ``host`` (None: :func:`default_host`); raises
        :class:`ConfigError` for a host name no member id can hold."""
        host = host or default_host()
        if not valid_name(host):
            raise ConfigError(f"invalid host name {host!r} for a member id")
        return cls(host, address, local_rank, dict(labels or {}), net_address, probe_port)

    def new_member_id(self) -> str:
        return f"{self.host}-{os.getpid()}-{secrets.token_hex(3)}"

    def member_record(self, member_id: str, lease_id: int) -> MemberRecord:
        rec = MemberRecord(
            member_id=member_id,
            host=self.host,
            address=self.address,
            pid=os.getpid(),
            local_rank=self.local_rank,
            lease_id=lease_id,
            version=__version__,
            started_unix=time.time(),
            net_address=self.net_address,
            probe_port=self.probe_port,
        )
        rec.labels.update(self.labels)
        return rec


@dataclass(frozen=True)
class Registration:
    """A member key in etcd: who, in which run, under which lease, with which settings
    (the run's, with this peer's own per-peer ones: :meth:`JobSettings.for_this_peer`)."""

    member_id: str
    run: RunRecord
    keys: RunKeys
    session: Session
    config: JobConfig
    #: ``time.monotonic()`` just before this registration granted or refreshed the run's
    #: lease (its keeper's first refresh falls due an interval after it); None when the
    #: process already kept the lease and did neither.
    run_lease_since: float | None = None


def register(client: EtcdClient, job: str, settings: JobSettings, identity: Identity,
             keeper: LeaseKeeper, on_lease_lost: Callable[[int, str], None],
             check_not_closed: Callable[[], None]) -> Registration:
    """Find or create ``job``'s run, then put a new member key under a fresh lease.

    ``check_not_closed`` raises to abandon the attempt (the caller closed meanwhile).
    Raises :class:`~peer_elastic.errors.JobFinished` (or the failure that ended the run)
    when the run is done, :class:`ConfigError` when ``settings`` differ from the run's.
    """
    wanted = settings.resolved()
    check_not_closed()
    session = Session(client, wanted.lease_ttl_s, keeper, on_lease_lost)
    member_id = identity.new_member_id()
    try:
        for _attempt in range(ATTEMPTS):
            run_kv = client.get(JobKeys(job).run_key)
            check_not_closed()  # close() during a rejoin: register nothing
            if run_kv is None:
                granted_since = time.monotonic()
                run = _create_run(client, job, wanted, identity, session, member_id)
                if run is not None:
                    return Registration(member_id, run, RunKeys(job, run.run_id), session,
                                        settings.for_this_peer(run.config), granted_since)
                continue
            run = _adopt_run(job, settings, run_kv.value, run_kv.key)
            keys = RunKeys(job, run.run_id)
            done = client.get(keys.done)
            if done is not None:
                raise done_error(job, decode(DoneRecord, done.value, done.key))
            rec = identity.member_record(member_id, session.lease_id)
            try:
                ok, _ = client.txn(
                    [Txn.mod(keys.run_key) == run_kv.mod_revision],
                    [Txn.put(keys.member(member_id), encode(rec), session.lease_id)],
                )
            except LeaseNotFound as exc:
                # The fresh lease expired before the registration was written: a process
                # too busy to refresh it in time (hundreds of members starting at once on
                # a starved host) is slow, not wrong. Nothing was written: a new lease.
                log.warning("job %s: registering %s again under a new lease: %s", job,
                            member_id, exc)
                session.close(revoke=False)
                session = Session(client, wanted.lease_ttl_s, keeper, on_lease_lost)
                continue
            if not ok:
                continue  # the run record changed since it was read
            refreshed_since = None
            if not keeper.keeps(run.lease_id):
                refreshed_since = time.monotonic()
                if not _run_lease_alive(client, run):
                    # The run ended as this peer joined it: its peers died up to run_ttl_s
                    # ago (a whole job restarted) and its lease ran out before anyone here
                    # kept it. Its keys went with the lease: the next attempt starts a run
                    # of its own (which resumes from the snapshots) instead of a member of
                    # no run.
                    log.info("job %s: run %s ended as %s joined it; registering again",
                             job, run.run_id, member_id)
                    session.close(revoke=True)  # the member key written into the ended run
                    session = Session(client, wanted.lease_ttl_s, keeper, on_lease_lost)
                    continue
            for difference in settings.per_peer_differences(run.config):
                log.warning("job %s: %s", job, difference)
            return Registration(member_id, run, keys, session,
                                settings.for_this_peer(run.config), refreshed_since)
        raise PeerElasticError(f"job {job!r}: the run record kept changing; "
                               f"could not register after {ATTEMPTS} attempts")
    except BaseException:
        session.close(revoke=True)
        raise


def _create_run(client: EtcdClient, job: str, cfg: JobConfig, identity: Identity,
                session: Session, member_id: str) -> RunRecord | None:
    """Create the run with our member key in it; None when another peer's run won."""
    run_lease = client.grant(cfg.run_ttl_s)
    run = RunRecord(
        run_id=f"r{int(time.time())}-{secrets.token_hex(4)}",
        lease_id=run_lease,
        created_unix=time.time(),
        created_by=member_id,
    )
    run.config.CopyFrom(cfg)
    keys = RunKeys(job, run.run_id)
    rec = identity.member_record(member_id, session.lease_id)
    data = encode(run)
    ok, resp = client.txn(
        [Txn.version(keys.run_key) == 0],
        [
            Txn.put(keys.run_key, data, run_lease),
            Txn.put(keys.member(member_id), encode(rec), session.lease_id),
        ],
        [Txn.get(keys.run_key)],
    )
    if not ok and holds(resp, data):
        # The client retried a create whose answer was lost after etcd applied it: the
        # run there is ours (its id is fresh), not a rival's. Revoking the lease would
        # delete the run we just created, and any peer that joined it meanwhile.
        ok = True
    if not ok:
        client.revoke(run_lease)
        return None
    log.info("started run %s of job %s", run.run_id, job)
    return run


def _run_lease_alive(client: EtcdClient, run: RunRecord) -> bool:
    """Refresh the lease of a run this process does not keep yet; False when it is gone.

    The registration's compare saw the run's key, but a run adopted from peers that died
    may have had a moment left on its lease: the first refresh decides, before the member
    acts as part of a run that no longer exists.
    """
    try:
        client.keepalive(run.lease_id)
    except LeaseNotFound:
        return False
    return True


def _adopt_run(job: str, settings: JobSettings, data: bytes, key: str) -> RunRecord:
    try:
        run = decode(RunRecord, data, key)
    except RecordError as exc:
        raise ConfigError(
            f"job {job!r} has an unreadable run record ({exc}). If no peer of it is "
            f"running, delete it: etcdctl del --prefix {JobKeys(job).prefix}"
        ) from None
    settings.check_against(run.config, job, adopt=set(run.overridden))
    return run
