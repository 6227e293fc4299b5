"""The public entry points: :func:`join` and :func:`run`.

Every argument of :func:`join` can come from the environment instead, so identical peers
started by systemd or a scheduler need none. The variables, their defaults and meanings are
listed in :func:`join`'s docstring, generated from the one table of them,
:mod:`peer_elastic.settings_table`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from peer_elastic import logs
from peer_elastic import settings_table as env
from peer_elastic.config import JobSettings
from peer_elastic.elastic import Peer
from peer_elastic.errors import (
    ConfigError,
    ElasticTimeout,
    JobFinished,
    PeerElasticError,
    ResetLimitExceeded,
    ShardedStateLost,
)
from peer_elastic.etcd.client import EtcdClient, client_from_env
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.liveness import EXIT_HUNG
from peer_elastic.metrics import NoopMetrics, PeerMetrics
from peer_elastic.process import netaddr, threads
from peer_elastic.process.netaddr import select_address
from peer_elastic.process.probe_listener import ProbeListener
from peer_elastic.process.signal_relay import SignalRelay
from peer_elastic.straggler.policy import EXIT_STRAGGLER

log = logging.getLogger(__name__)

R = TypeVar("R")

#: Exit code of a peer whose job failed as a whole (reset limit, elastic timeout, a failed
#: ``done`` record): restarting it cannot help. A crash of the peer itself exits otherwise.
EXIT_JOB_FAILED = 4
#: How long join()'s cleanup waits for the threads of the peer to end.
THREADS_END_WAIT_S = 10.0

#: Exit code of a peer whose training thread hung (``hang_timeout_s``): it fenced itself out
#: of the job; restarted, it joins as a new member (defined in :mod:`peer_elastic.liveness`).
__all__ = ["EXIT_HUNG", "EXIT_JOB_FAILED", "EXIT_STRAGGLER", "connect", "current_peer", "join",
           "local_rank_from_env", "run"]

#: Other launchers' names for the local rank, read when ``PEER_ELASTIC_LOCAL_RANK`` is
#: unset (in this order): a script started by torchrun or srun finds its slot too.
OTHER_LOCAL_RANKS = (
    env.EnvVar("LOCAL_RANK", int, None, "torchrun's local rank"),
    env.EnvVar("SLURM_LOCALID", int, None, "Slurm's local task id"),
)


def local_rank_from_env(environ: Mapping[str, str] | None = None) -> int:
    """This process's slot on its host (``peer.local_rank``): ``PEER_ELASTIC_LOCAL_RANK``,
    else torchrun's ``LOCAL_RANK``, else Slurm's ``SLURM_LOCALID``, else 0."""
    for var in (env.LOCAL_RANK, *OTHER_LOCAL_RANKS):
        if var.raw(environ) is not None:
            return int(var.value(environ))
    return 0


_active: Peer | None = None
_open_joins = 0  # join() blocks of this process not yet cleaned up
_open_joins_lock = threading.Lock()


def _enter_open_joins() -> None:
    global _open_joins
    with _open_joins_lock:
        _open_joins += 1


def _leave_open_joins() -> int:
    """One join() fewer; how many are still open."""
    global _open_joins
    with _open_joins_lock:
        _open_joins -= 1
        return _open_joins


def connect(etcd: str | None = None) -> EtcdClient:
    """An etcd client from ``etcd`` or ``PEER_ELASTIC_ETCD`` (plus TLS/auth variables)."""
    if not (etcd or env.ETCD.raw()):
        raise ConfigError(f"no etcd endpoints: pass etcd='host:port' or set {env.ETCD.env}")
    return client_from_env(etcd)


@contextlib.contextmanager
def join(
    job: str | None = None,
    etcd: str | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    backend: str | None = None,
    collective_timeout_s: float | None = None,
    abandon_hung_collectives: bool | None = None,
    host: str | None = None,
    labels: Mapping[str, str] | None = None,
    handle_sigterm: bool = True,
    **settings: Any,
) -> Iterator[Peer]:
    """Join (or start) an elastic job; leaving the block leaves the job gracefully.

    ``settings`` are the other job settings (``lease_ttl_s``, ``join_timeout_s``,
    ``elastic_timeout_s``, ``reset_limit``, ``hang_timeout_s``, ...). ``hang_timeout_s``
    (default 30 s, 0 = off): a peer whose training thread spends that long inside the
    training function, outside any collective, without reaching a step
    (``check_host_updates()``/``commit()``) is hung; it dumps the stacks of all its threads
    to stderr, records a ``hung`` event, leaves the job at once and exits
    :data:`EXIT_HUNG` (5), so a supervisor restarts it. ``abandon_hung_collectives`` (default on)
    makes a collective that waits on a peer whose lease is gone fail ``join_timeout_s``
    later instead of at the collective timeout. With ``handle_sigterm`` (and when called
    from the main thread) SIGTERM drains this peer: the others reset at their next check
    without rolling back, and this one exits 0 once they re-formed.

    An argument left out is read from its environment variable:

    {variables}
    """
    global _active
    job = job or env.JOB.raw()
    if not job:
        raise ConfigError(f"no job name: pass job='name' or set {env.JOB.env}")
    logs.setup()
    job_settings = JobSettings.from_env(min_np=min_np, max_np=max_np, **settings)
    local_rank = local_rank_from_env()
    client = connect(etcd)
    # Before the Coordinator: the member record publishes where to scrape (its address).
    metrics = PeerMetrics.from_env(local_rank=local_rank, host=host)
    probe: ProbeListener | None = None
    try:
        net_address, probe = _group_address(client)
        coord = Coordinator(client, job, job_settings, host=host, labels=labels,
                            local_rank=local_rank, address=metrics.address,
                            net_address=net_address, probe_port=probe.port if probe else 0)
    except BaseException:
        if probe is not None:
            probe.close()
        metrics.close()
        client.close()
        raise
    peer: Peer | None = None
    on_sigterm: SignalRelay | None = None
    _enter_open_joins()
    try:
        with _exit_with_the_jobs_verdict():
            coord.start()
            logs.set_context(member=coord.member_id)
            peer = _make_peer(coord, metrics, local_rank, backend, collective_timeout_s,
                              abandon_hung_collectives)
            if handle_sigterm and threading.current_thread() is threading.main_thread():
                on_sigterm = SignalRelay((signal.SIGTERM,), _leave_on_signal(coord)).install()
            _active = peer
            yield peer
    finally:
        _active = None
        if on_sigterm is not None:
            on_sigterm.uninstall()
        _close_join(peer, coord, client, metrics, probe)


def _group_address(client: EtcdClient) -> tuple[str, ProbeListener | None]:
    """Which address this peer's groups use (gloo's own pick can be 127.0.1.1; "" leaves it
    to gloo), and a listener on it, so that the others can check they reach it before
    forming a group."""
    net = select_address((e.host, e.port) for e in getattr(client, "endpoints", ()))
    log.info("process groups use %s (%s%s)", net.address or "gloo's choice", net.how,
             f", interface {net.ifname}" if net.ifname else "")
    if not net.address:
        return net.address, None
    try:
        return net.address, ProbeListener(net.address)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {net.address}, the address chosen for "
                          f"this peer's process groups ({net.how}): {exc}; "
                          f"{netaddr.FIX}") from None


@contextlib.contextmanager
def _exit_with_the_jobs_verdict() -> Iterator[None]:
    """A job that finished or failed as a whole ends this process with one line and the
    job's verdict as the exit code."""
    try:
        yield
    except JobFinished as exc:
        # A late joiner or a standby of a finished job: 0 when it succeeded,
        # EXIT_JOB_FAILED when it failed, so a unit with Restart=on-failure and
        # RestartPreventExitStatus=EXIT_JOB_FAILED stops here.
        print(f"peer-elastic: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(0 if exc.success else EXIT_JOB_FAILED) from None
    except (ElasticTimeout, ResetLimitExceeded, ShardedStateLost) as exc:
        print(f"peer-elastic: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_JOB_FAILED) from None


def _close_join(peer: Peer | None, coord: Coordinator, client: EtcdClient,
                metrics: PeerMetrics | NoopMetrics, probe: ProbeListener | None) -> None:
    """Everything :func:`join` opened, closed: the peer leaves the job gracefully."""
    if peer is not None:
        peer.close()
    coord.close(leave=True)
    client.close()
    metrics.close()
    if probe is not None:
        probe.close()
    # Last: no thread of this peer may still run when the process exits after join()
    # (peer_elastic.process.threads). Each was asked to stop above; this only waits, and only
    # when no other join() of this process is open (its threads run on, by design).
    if _leave_open_joins() == 0 and (left := threads.wait_all_ended(THREADS_END_WAIT_S)):
        log.warning("threads still running %.0f s after the peer closed (the process "
                    "may abort or hang at exit): %s", THREADS_END_WAIT_S, ", ".join(left))


if join.__doc__:  # None under python -OO
    join.__doc__ = join.__doc__.replace(
        "{variables}", env.doc_table().replace("\n", "\n    "))


def _make_peer(coord: Coordinator, metrics: PeerMetrics | NoopMetrics, local_rank: int,
               backend: str | None, collective_timeout_s: float | None,
               abandon_hung_collectives: bool | None) -> Peer:
    """The :class:`Peer` of ``coord``, with what :func:`join` did not set read from the
    environment; with nccl, its GPU chosen by the local rank."""
    peer = Peer(
        coord,
        backend=backend or env.BACKEND.value(),
        collective_timeout_s=collective_timeout_s or env.COLLECTIVE_TIMEOUT.value(),
        metrics=metrics,
        abandon_hung_collectives=abandon_hung_collectives
        if abandon_hung_collectives is not None else env.ABANDON_COLLECTIVES.value(),
    )
    if peer.groups.backend == "nccl":
        import torch

        # One GPU per local slot: the local rank (local_rank_from_env) picks the device
        # before any collective runs.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return peer


def _leave_on_signal(coord: Coordinator) -> Callable[[int], None]:
    """What SIGTERM does, on the signal relay's thread (never in the handler: see
    :mod:`peer_elastic.process.signal_relay`): the first asks to leave, later ones only say so."""
    asked = threading.Event()

    def leave(signum: int) -> None:
        if asked.is_set():
            log.info("signal %d: already leaving job %s", signum, coord.job)
            return
        asked.set()
        log.info("signal %d: leaving job %s gracefully", signum, coord.job)
        try:  # request_leave sets drain_requested first, then writes the drain
            coord.request_leave("SIGTERM")
        except PeerElasticError as exc:
            log.error("could not request a graceful leave: %s", exc)

    return leave


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorator form of :meth:`Peer.run`, as ``hvd.elastic.run``.

    Inside a ``join`` block it uses that peer; outside, it joins from the environment for
    the duration of the call.
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> R:
        if _active is not None:
            return _active.run(func, state, *args, **kwargs)
        with join() as peer:
            return peer.run(func, state, *args, **kwargs)

    return wrapper


def current_peer() -> Peer:
    """The peer of the enclosing :func:`join` block."""
    if _active is None:
        raise PeerElasticError("not inside peer_elastic.join()")
    return _active
