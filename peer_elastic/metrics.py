"""Optional Prometheus metrics for one peer (the ``metrics`` extra: ``prometheus-client``).

Off unless ``PEER_ELASTIC_METRICS_PORT`` is set (read by :func:`peer_elastic.join`)::

    PEER_ELASTIC_METRICS_PORT=9400       # scrape port; the peer in local slot i uses 9400 + i
    PEER_ELASTIC_METRICS_PORT=0          # any free port (the member record says which)
    PEER_ELASTIC_METRICS_ADDR=0.0.0.0    # listen address (default 127.0.0.1)

Every peer serves its own ``/metrics`` from a :class:`PeerMetrics` that owns a private
``CollectorRegistry`` (never the global one), so several peers in one process do not clash
and the application's own metrics stay separate. The ``host:port`` to scrape is published
in the peer's member record (``address``), which ``peer-elastic status`` reads.

Without ``prometheus_client``, or with metrics off, :meth:`PeerMetrics.create` returns a
:class:`NoopMetrics`, and :class:`~peer_elastic.elastic.Peer` keeps ``metrics = None``: the
training hot path then runs exactly the code it runs without this module. Both are
step observers (:class:`~peer_elastic.observer.StepObserver`): the peer tells them about
its checks, commits, syncs and resets; they never reach into the peer's state.

What is measured (see ``docs/metrics.md``):

* gauges read live at scrape time from the peer: ``peer_elastic_generation``,
  ``peer_elastic_world_size``, ``peer_elastic_rank`` (the group it last formed; -1 / 0 while
  a standby), ``peer_elastic_is_leader``, and from its watched view of etcd (no I/O)
  ``peer_elastic_latest_generation``, ``peer_elastic_members``, ``peer_elastic_min_np``,
  ``peer_elastic_max_np``; ``Coordinator.counters`` and ``Peer.stats`` as
  ``peer_elastic_coordinator_*_total``;
* ``peer_elastic_resets_total{reason}``: resets this peer went through (the first group it
  joins is not a reset, as for ``Peer.resets``), by a bounded set of reasons
  (:data:`REASONS`); ``peer_elastic_last_recovery_seconds``;
* ``peer_elastic_straggler_score``, ``peer_elastic_step_own_seconds``,
  ``peer_elastic_step_waited_seconds``: this peer's pace at the group's last exchange
  (:mod:`peer_elastic.straggler`);
* histograms ``peer_elastic_commit_seconds`` (``state.commit()``: save + check),
  ``peer_elastic_check_seconds`` (``check_host_updates``: one all-reduce) and
  ``peer_elastic_sync_seconds`` (agreeing on and syncing state after a reset, when a sync
  happened).
"""

from __future__ import annotations

import importlib
import logging
import math
import socket
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from peer_elastic.errors import ConfigError
from peer_elastic.observer import NoObserver
from peer_elastic.records import GenerationCause
from peer_elastic.settings_table import HOST, METRICS_ADDR, METRICS_PORT

if TYPE_CHECKING:
    from peer_elastic.elastic import Peer

log = logging.getLogger(__name__)

__all__ = [
    "CHECK_BUCKETS",
    "COMMIT_BUCKETS",
    "ENV_ADDR",
    "ENV_PORT",
    "REASONS",
    "SYNC_BUCKETS",
    "NoopMetrics",
    "PeerMetrics",
    "classify_reason",
    "prometheus_available",
]

ENV_PORT = METRICS_PORT.env
ENV_ADDR = METRICS_ADDR.env
DEFAULT_ADDR: str = METRICS_ADDR.default

#: Every value the ``reason`` label of ``peer_elastic_resets_total`` can take. Member ids
#: never become labels: they would make the number of series grow without bound.
REASONS = ("joined", "left", "crash", "hung", "lease_lost", "other")

#: ``state.commit()``: an in-memory copy of the state plus one tiny all-reduce; from tens
#: of microseconds (small models) to seconds (large models on a slow copy).
COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                  0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: ``check_host_updates``: one all-reduce of one int64 (tens of microseconds on one host).
CHECK_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Agreeing on and syncing the state after a reset: a broadcast of the whole state.
SYNC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0)

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")
#: prometheus_client's start_http_server returns (server, thread) from this version on;
#: before it returned None, so port 0 cannot be read back and is picked beforehand.
_RETURNS_SERVER_SINCE = (0, 20)


def prometheus_available() -> bool:
    """True iff ``prometheus_client`` can be imported."""
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        return False
    return True


def classify_reason(causes: Collection[int], *, crashed: bool = False,
                    lease_lost: bool = False) -> str:
    """Map a reset onto one of :data:`REASONS`.

    ``causes`` are the generation's :class:`~peer_elastic.records.GenerationCause` values as
    the leader wrote them (see :mod:`peer_elastic.etcd.roster`); ``crashed`` says this peer
    came through the failed-collective path (it restored its last commit), ``lease_lost``
    that it lost its lease and re-registered. When several causes apply, the most severe
    wins: lease_lost, crash (a broken generation, a member dropped for not acknowledging or
    cut off from the others),
    hung (a member was fenced for a hung training thread), left (a member left, expired or
    no longer fits), joined; anything else is ``other``.
    """
    if lease_lost:
        return "lease_lost"
    found = set(causes)
    if crashed or found & _CRASH_CAUSES:
        return "crash"
    if GenerationCause.GENERATION_CAUSE_HUNG in found:
        return "hung"
    if found & _LEFT_CAUSES:
        return "left"
    if GenerationCause.GENERATION_CAUSE_JOINED in found:
        return "joined"
    return "other"


_CRASH_CAUSES = {GenerationCause.GENERATION_CAUSE_BROKEN, GenerationCause.GENERATION_CAUSE_DROPPED,
                 GenerationCause.GENERATION_CAUSE_UNREACHABLE}
_LEFT_CAUSES = {GenerationCause.GENERATION_CAUSE_LEFT, GenerationCause.GENERATION_CAUSE_EXPIRED,
                GenerationCause.GENERATION_CAUSE_RESIZED}


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _returns_server() -> bool:
    try:
        from importlib.metadata import version

        return _version_tuple(version("prometheus-client")) >= _RETURNS_SERVER_SINCE
    except Exception:  # not installed as a distribution (vendored): assume a current one
        return True


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr.strip("[]"), 0))
        return int(s.getsockname()[1])


def _host_port(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _safe(read: Callable[[], Any], default: float = math.nan) -> Callable[[], float]:
    """A gauge function that never raises in the scrape thread (a peer in mid-reset)."""

    def value() -> float:
        try:
            return float(read())
        except Exception:
            return default

    return value


def _number(gen: Any) -> float:
    return float(gen.number) if gen is not None else 0.0


class _CoordinatorStats:
    """``Coordinator.counters`` and the peer's :class:`~peer_elastic.observer.PeerStats` as
    counters, read at scrape time: ``peer_elastic_coordinator_<name>_total``
    (generations_written, cas_lost, rejoins, dropped: what this peer's coordination thread
    did; collectives_abandoned: what its hang watchdog did; snapshots_*: its durable
    snapshot writer; check_exchanges, checks_spaced: its plain checks; states_lost: groups
    formed after every holder of the state was lost)."""

    HELP = {
        "generations_written": "Generations this peer wrote as leader",
        "cas_lost": "Generation writes this peer lost to a concurrent leader (compare-and-swap)",
        "rejoins": "Times this peer re-registered after losing its lease",
        "dropped": "Silent members this peer dropped as leader (no ack within join_timeout)",
        "collectives_abandoned": "Groups whose stuck collectives this peer abandoned because "
                                 "a member's lease ended",
        "snapshots_written": "Durable snapshots this peer wrote",
        "snapshots_failed": "Durable snapshots this peer failed to write (training went on)",
        "snapshots_skipped": "Due durable snapshots this peer skipped because the previous "
                             "write was still in flight",
        "check_exchanges": "Plain checks that exchanged the newest generation with the group",
        "checks_spaced": "Plain checks that returned without an exchange, between two "
                         "(checks coming faster than an exchange is worth)",
        "states_lost": "Groups this peer formed in which nobody held the run's committed "
                       "state any more (every peer that held it was lost at once)",
    }

    def __init__(self, peer: Peer) -> None:
        self._peer = peer

    def describe(self) -> list[Any]:
        return list(self._families({}))

    def collect(self) -> list[Any]:
        try:
            stats = self._peer.coordinator.counters.as_dict() | self._peer.stats.as_dict()
        except Exception:
            stats = {}
        return list(self._families(stats))

    def _families(self, stats: dict[str, Any]) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for name, help_text in self.HELP.items():
            value = stats.get(name, 0)
            yield CounterMetricFamily(f"peer_elastic_coordinator_{name}", help_text,
                                      value=float(value) if isinstance(value, (int, float)) else 0.0)


class NoopMetrics(NoObserver):
    """What :meth:`PeerMetrics.create` returns when metrics are off or unavailable.

    Every method does nothing; :class:`~peer_elastic.elastic.Peer` stores ``None`` instead
    of this object, so no hook runs at all.
    """

    enabled = False
    port: int | None = None
    address = ""

    def __bool__(self) -> bool:
        return False

    def record_reset(self, causes: Collection[int], seconds: float, *, crashed: bool = False,
                     lease_lost: bool = False) -> str:
        return classify_reason(causes, crashed=crashed, lease_lost=lease_lost)

    def observe_commit(self, seconds: float) -> None:
        pass

    def observe_check(self, seconds: float) -> None:
        pass

    def observe_sync(self, seconds: float) -> None:
        pass

    # The StepObserver hooks (bind, on_check, on_sync, on_reset) are NoObserver's: nothing.

    def start_http_server(self, port: int = 0, addr: str = DEFAULT_ADDR) -> int | None:
        return None

    def render(self) -> str:
        return ""

    def close(self) -> None:
        pass


class PeerMetrics:
    """One peer's metrics in a private registry, optionally served over HTTP.

    Create with :meth:`create` (or :meth:`from_env`), which falls back to
    :class:`NoopMetrics`; the constructor itself raises ImportError without
    ``prometheus_client``.
    """

    enabled = True

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.generation = Gauge("peer_elastic_generation",
                                "Generation of the group this peer last formed (0: none yet)",
                                registry=r)
        self.world_size = Gauge("peer_elastic_world_size",
                                "Ranks in the group this peer last formed (0: standby, none yet)",
                                registry=r)
        self.rank = Gauge("peer_elastic_rank",
                          "This peer's rank in the group it last formed (-1: standby, none yet)",
                          registry=r)
        self.is_leader = Gauge("peer_elastic_is_leader",
                               "1 if this peer leads the job (writes generations)", registry=r)
        self.latest_generation = Gauge("peer_elastic_latest_generation",
                                       "Newest generation written for the job, as this peer "
                                       "sees it (above peer_elastic_generation: resetting)",
                                       registry=r)
        self.members = Gauge("peer_elastic_members",
                             "Live, eligible members of the job, as this peer sees them "
                             "(standbys included)", registry=r)
        self.min_np = Gauge("peer_elastic_min_np", "The job's min_np setting", registry=r)
        self.max_np = Gauge("peer_elastic_max_np",
                            "The job's max_np setting (0: unlimited)", registry=r)
        self.resets = Counter("peer_elastic_resets",
                              "Resets this peer went through (the first group is not one), "
                              "by cause", ["reason"], registry=r)
        for reason in REASONS:  # every series exists from the start, so rate() sees the 1st
            self.resets.labels(reason=reason)
        self.last_recovery = Gauge("peer_elastic_last_recovery_seconds",
                                   "Seconds the last reset took on this peer, from the "
                                   "interrupt to the synced group", registry=r)
        self.commit_seconds = Histogram("peer_elastic_commit_seconds",
                                        "state.commit(): save in memory + check_host_updates",
                                        buckets=COMMIT_BUCKETS, registry=r)
        self.check_seconds = Histogram("peer_elastic_check_seconds",
                                       "check_host_updates(): one all-reduce on the group",
                                       buckets=CHECK_BUCKETS, registry=r)
        self.sync_seconds = Histogram("peer_elastic_sync_seconds",
                                      "Agreeing on and syncing state after a reset (only "
                                      "resets that synced)", buckets=SYNC_BUCKETS, registry=r)
        self.straggler_score = Gauge(
            "peer_elastic_straggler_score",
            "This peer's straggler score at the group's last exchange of paces: its own time "
            "per step (outside waits on the others) over the median of the other peers' (1: "
            "the group's pace; NaN before the first exchange)", registry=r)
        self.step_own = Gauge("peer_elastic_step_own_seconds",
                              "This peer's own time per check (outside waits on the others) "
                              "at the last exchange of paces", registry=r)
        self.step_waited = Gauge("peer_elastic_step_waited_seconds",
                                 "This peer's time per check waiting on the other peers at the "
                                 "last exchange of paces", registry=r)
        self.info = Info("peer_elastic", "The job and host of this peer", registry=r)
        self.rank.set(-1)
        self.port: int | None = None
        self.address = ""
        self._server: Any = None
        self._thread: Any = None
        self._peer: Peer | None = None
        self._stats: _CoordinatorStats | None = None

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def create(cls, enabled: bool = True) -> PeerMetrics | NoopMetrics:
        """A :class:`PeerMetrics`, or a :class:`NoopMetrics` when ``enabled`` is false or
        ``prometheus_client`` is missing (with a warning: metrics were asked for)."""
        if not enabled:
            return NoopMetrics()
        try:
            return cls()
        except ImportError:
            log.warning("metrics requested but prometheus_client is not installed "
                        "(pip install 'peer-elastic[metrics]'): metrics are off")
            return NoopMetrics()

    @classmethod
    def from_env(cls, *, local_rank: int = 0, host: str | None = None,
                 env: Mapping[str, str] | None = None) -> PeerMetrics | NoopMetrics:
        """Metrics as ``PEER_ELASTIC_METRICS_PORT`` / ``_ADDR`` ask, already serving.

        Unset port: a :class:`NoopMetrics`. Port 0: any free port. Any other port ``p``:
        ``p + local_rank``, so the peers of one host (systemd instances, ``peer-elastic
        run``) sharing one environment get distinct, predictable ports. When the port
        cannot be bound, training goes on without metrics (logged as an error).
        """
        raw = METRICS_PORT.raw(env)
        if not raw:
            return NoopMetrics()
        try:
            port = int(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PORT}={raw!r} is not a port number") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"{ENV_PORT}={raw!r} is not a port number (0-65535)")
        if port:
            port += local_rank
            if port > 65535:
                raise ConfigError(f"{ENV_PORT}={raw} + local rank {local_rank} is past 65535")
        addr = METRICS_ADDR.raw(env) or DEFAULT_ADDR
        metrics = cls.create()
        if not metrics.enabled:
            return metrics
        try:
            metrics.start_http_server(port, addr, host_name=host)
        except OSError as exc:
            log.error("metrics: cannot listen on %s: %s; training goes on without metrics",
                      _host_port(addr, port), exc)
            metrics.close()
            return NoopMetrics()
        log.info("metrics at http://%s/metrics", metrics.address)
        return metrics

    # -- the peer ---------------------------------------------------------------------------------

    def bind(self, peer: Peer) -> None:
        """Read the gauges from ``peer`` at every scrape (``generation``, ``size``, ``rank``,
        ``is_leader``, its stats and its coordinator's view and config)."""
        self._peer = peer
        self.generation.set_function(_safe(lambda: peer.generation))
        self.world_size.set_function(_safe(lambda: peer.size))
        self.rank.set_function(_safe(lambda: peer.rank, -1.0))
        self.is_leader.set_function(_safe(lambda: peer.is_leader, 0.0))
        coord = peer.coordinator
        self.latest_generation.set_function(_safe(lambda: _number(coord.latest_generation)))
        self.members.set_function(_safe(lambda: len(coord.snapshot().eligible())))
        self.min_np.set_function(_safe(lambda: coord.config.min_np))
        self.max_np.set_function(_safe(lambda: coord.config.max_np))
        self.straggler_score.set_function(_safe(lambda: peer.straggler.score))
        self.step_own.set_function(_safe(lambda: peer.straggler.own_s))
        self.step_waited.set_function(_safe(lambda: peer.straggler.waited_s))
        from peer_elastic import __version__

        self.info.info({"elastic_job": str(coord.job), "host": str(coord.host),
                        "version": __version__})
        if self._stats is None:
            self._stats = _CoordinatorStats(peer)
            self.registry.register(self._stats)

    def record_reset(self, causes: Collection[int], seconds: float, *, crashed: bool = False,
                     lease_lost: bool = False) -> str:
        """Count one reset (not the first group) under its classified reason; returns it."""
        label = classify_reason(causes, crashed=crashed, lease_lost=lease_lost)
        self.resets.labels(reason=label).inc()
        self.last_recovery.set(seconds)
        return label

    def observe_commit(self, seconds: float) -> None:
        self.commit_seconds.observe(seconds)

    def observe_check(self, seconds: float) -> None:
        self.check_seconds.observe(seconds)

    def observe_sync(self, seconds: float) -> None:
        self.sync_seconds.observe(seconds)

    # -- StepObserver (peer_elastic.observer): what the peer tells --------------------------------

    def on_check(self, seconds: float, *, committing: bool) -> None:
        """A check (``check_host_updates``, or the one inside ``commit()``) and, when
        ``committing``, the commit it belongs to: both histograms."""
        self.check_seconds.observe(seconds)
        if committing:
            self.commit_seconds.observe(seconds)

    def on_sync(self, seconds: float) -> None:
        self.sync_seconds.observe(seconds)

    def on_reset(self, causes: Collection[int], seconds: float, *, crashed: bool,
                 lease_lost: bool) -> None:
        self.record_reset(causes, seconds, crashed=crashed, lease_lost=lease_lost)

    # -- serving ----------------------------------------------------------------------------------

    def start_http_server(self, port: int = 0, addr: str = DEFAULT_ADDR, *,
                          host_name: str | None = None) -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: a free port) from a daemon thread.

        Returns the port actually bound, also kept in :attr:`port`. :attr:`address` becomes
        the ``host:port`` to scrape: ``addr`` itself, or for a wildcard ``addr`` (``0.0.0.0``,
        ``::``) ``host_name`` (default ``$PEER_ELASTIC_HOST``, else the machine's name).
        Calling it again while serving returns the running server's port.
        """
        if self.port is not None:
            return self.port
        from prometheus_client import start_http_server as start

        bind_port = port
        returns_server = _returns_server()
        if port == 0 and not returns_server:
            bind_port = _free_port(addr)  # old prometheus_client: cannot read port 0 back
        result = start(bind_port, addr=addr.strip("[]"), registry=self.registry)
        if isinstance(result, tuple) and result:
            self._server = result[0]
            self._thread = result[1] if len(result) > 1 else None
            actual = int(self._server.server_address[1])
        else:
            actual = bind_port
        self.port = actual
        if addr in _WILDCARDS:
            host = host_name or HOST.raw() or socket.gethostname()
        else:
            host = addr
        self.address = _host_port(host, actual)
        return actual

    def render(self) -> str:
        """The exposition text a scrape would get (for tests and debugging)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")

    def close(self) -> None:
        """Stop serving (servers of prometheus_client < 0.20 cannot be stopped: they are
        daemon threads and end with the process)."""
        server, self._server = self._server, None
        if server is not None:
            try:
                server.shutdown()
                server.server_close()
            except Exception as exc:  # pragma: no cover - best effort at exit
                log.debug("metrics server did not stop cleanly: %s", exc)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
        self.port = None
        self.address = ""
