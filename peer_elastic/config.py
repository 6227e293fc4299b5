"""Job settings: defaults, environment variables, validation, and agreement between peers.

Every peer of a run must agree on the job settings. The first peer writes them (inside the
run record); a later peer adopts whatever it did not set itself, and fails with a message
naming both values when it set something differently. Identical peers started by systemd
therefore need no arguments: everything can come from ``PEER_ELASTIC_*`` variables.

The exception is :data:`PER_PEER`: settings that name something on this peer's own machine
(``snapshot_dir``, a directory whose files a peer loads). A peer takes them only from its own
arguments and environment, never from etcd: whoever can write the job's prefix must not be
able to point a peer at files of their choosing (:meth:`JobSettings.for_this_peer`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Any

from peer_elastic.errors import ConfigError
from peer_elastic.records import JobConfig
from peer_elastic.setting_rules import setting_problem
from peer_elastic.settings_table import JOB_SETTINGS, EnvVar

log = logging.getLogger(__name__)


#: Every job setting, its environment variable and default: the job rows of the one table of
#: environment variables (:mod:`peer_elastic.settings_table`).
JOB_FIELDS: tuple[EnvVar, ...] = JOB_SETTINGS
_BY_NAME = {f.name: f for f in JOB_FIELDS}

#: Job settings each peer takes from its own arguments and environment only. The run record
#: carries the first peer's value (``status`` shows it); no peer ever uses it.
PER_PEER: frozenset[str] = frozenset({"snapshot_dir"})


@dataclass(frozen=True)
class JobSettings:
    """Job settings as one peer was given them. ``None`` means "not set here: adopt"."""

    min_np: int | None = None
    max_np: int | None = None
    lease_ttl_s: float | None = None
    join_timeout_s: float | None = None
    elastic_timeout_s: float | None = None
    reset_limit: int | None = None
    blacklist_after: int | None = None
    blacklist_cooldown_s: float | None = None
    settle_s: float | None = None
    start_settle_s: float | None = None
    run_ttl_s: float | None = None
    hang_timeout_s: float | None = None
    snapshot_dir: str | None = None
    snapshot_every_s: float | None = None
    snapshot_keep: int | None = None
    hang_first_step_s: float | None = None
    straggler_policy: str | None = None
    straggler_threshold: float | None = None
    straggler_window_s: float | None = None
    straggler_cooldown_s: float | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> JobSettings:
        """Settings from ``PEER_ELASTIC_*`` variables; explicit ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in JOB_FIELDS:
            raw = env.get(f.env)
            if raw is not None and raw.strip() != "":
                try:
                    values[f.name] = f.kind(raw)
                except ValueError:
                    raise ConfigError(f"{f.env}={raw!r} is not a valid {f.kind.__name__}") from None
        for k, v in overrides.items():
            if k not in _BY_NAME:
                raise ConfigError(f"unknown job setting {k!r}")
            if v is not None:
                values[k] = v
        return cls(**values)

    def resolved(self) -> JobConfig:
        """The full config this peer would write if it started the run."""
        cfg = JobConfig()
        for f in JOB_FIELDS:
            v = getattr(self, f.name)
            setattr(cfg, f.name, f.default if v is None else v)
        validate(cfg)
        return cfg

    def check_against(self, job: JobConfig, job_name: str, adopt: set[str] | None = None) -> None:
        """Raise :class:`ConfigError` naming every setting this peer set differently.

        Settings in ``adopt`` were changed while the job ran (``peer-elastic set``): a peer
        started from an older environment file adopts them with a warning instead of failing.
        """
        diffs = []
        for f in JOB_FIELDS:
            mine = getattr(self, f.name)
            if mine is None or f.name in PER_PEER:
                continue
            if adopt and f.name in adopt:
                if mine != getattr(job, f.name):
                    log.warning("%s: adopting %s=%r, changed while the job ran (this peer has "
                                "%r)", job_name, f.name, getattr(job, f.name), mine)
                continue
            theirs = getattr(job, f.name)
            same = abs(mine - theirs) < 1e-9 if f.kind is float else mine == theirs
            if not same:
                diffs.append(f"{f.name}: this peer has {mine!r} ({f.env}), the job has {theirs!r}")
        if diffs:
            raise ConfigError(
                f"settings differ from job {job_name!r}'s running run: " + "; ".join(diffs)
                + ". Start this peer with the job's settings, leave them unset to adopt them, "
                "or change the job's settings."
            )

    def for_this_peer(self, job: JobConfig) -> JobConfig:
        """The run's settings as this peer applies them: ``job`` (read from etcd), except
        that every :data:`PER_PEER` setting is this peer's own value (its default when unset
        here), whatever the run record says."""
        mine = JobConfig()
        mine.CopyFrom(job)
        for name in PER_PEER:
            value = getattr(self, name)
            setattr(mine, name, _BY_NAME[name].default if value is None else value)
        return mine

    def per_peer_differences(self, job: JobConfig) -> list[str]:
        """For a person: each :data:`PER_PEER` setting where this peer differs from the run's
        first peer, and what this peer does about it (it uses its own)."""
        out = []
        for name in sorted(PER_PEER):
            f = _BY_NAME[name]
            mine = getattr(self.for_this_peer(job), name)
            theirs = getattr(job, name)
            if mine == theirs:
                continue
            if not mine:
                out.append(f"{name}: the run's first peer has {theirs!r}; this peer has none "
                           f"({f.env} unset), so it writes and resumes from no durable "
                           f"snapshots. A value in etcd is never used: set {f.env} on this "
                           f"peer to take part")
            else:
                out.append(f"{name}: this peer uses its own {mine!r} ({f.env}); the run's first "
                           f"peer has {theirs!r}")
        return out


def validate(cfg: JobConfig) -> None:
    """Reject settings no job can run with, with a message that says which and why.

    The rules are :func:`peer_elastic.setting_rules.setting_problem`'s, the same that a run
    record read from etcd must pass."""
    problem = setting_problem(cfg)
    if problem is not None:
        raise ConfigError(str(problem))


def config_dict(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in JOB_FIELDS} | {"paused": cfg.paused}


assert {f.name for f in fields(JobSettings)} == set(_BY_NAME)
