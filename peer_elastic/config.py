"""Job settings: defaults, environment variables, validation, and agreement between peers.

Every peer of a run must agree on the job settings. The first peer writes them (inside the
run record); a later peer adopts whatever it did not set itself, and fails with a message
naming both values when it set something differently. Identical peers started by systemd
therefore need no arguments: everything can come from ``PEER_ELASTIC_*`` variables.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from peer_elastic.errors import ConfigError
from peer_elastic.records import JobConfig
from peer_elastic.settings_table import JOB_SETTINGS, EnvVar

log = logging.getLogger(__name__)


#: The shortest hang_timeout_s other than 0 (off). The hang monitor starts the clock afresh
#: when it wakes this much later than planned (peer_elastic.liveness.FREEZE_SLACK_S): below
#: it, a pause of the whole process would be blamed on the training thread.
MIN_HANG_TIMEOUT_S = 1.0

#: Every job setting, its environment variable and default: the job rows of the one table of
#: environment variables (:mod:`peer_elastic.settings_table`).
JOB_FIELDS: tuple[EnvVar, ...] = JOB_SETTINGS
_BY_NAME = {f.name: f for f in JOB_FIELDS}


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
            if mine is None:
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


def validate(cfg: JobConfig) -> None:
    """Reject settings no job can run with, with a message that says which and why."""
    for f in JOB_FIELDS:
        # NaN passes every comparison below (all are False), and inf disables a timeout or
        # a lease silently: neither is a setting anyone means.
        if f.kind is float and not math.isfinite(getattr(cfg, f.name)):
            raise ConfigError(f"{f.name} must be a finite number, got {getattr(cfg, f.name)} "
                              f"({f.env})")
    if cfg.min_np < 1:
        raise ConfigError(f"min_np must be at least 1, got {cfg.min_np}")
    if cfg.max_np and cfg.max_np < cfg.min_np:
        raise ConfigError(f"max_np ({cfg.max_np}) is smaller than min_np ({cfg.min_np})")
    if cfg.lease_ttl_s < 1:
        raise ConfigError(f"lease_ttl_s must be at least 1 s (etcd grants whole seconds), "
                          f"got {cfg.lease_ttl_s}")
    for name in ("join_timeout_s", "elastic_timeout_s", "blacklist_cooldown_s", "run_ttl_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    for name in ("settle_s", "start_settle_s", "hang_first_step_s"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must not be negative, got {getattr(cfg, name)}")
    if cfg.hang_timeout_s != 0 and not cfg.hang_timeout_s >= MIN_HANG_TIMEOUT_S:
        raise ConfigError(
            f"hang_timeout_s must be 0 (off) or at least {MIN_HANG_TIMEOUT_S:g} s, got "
            f"{cfg.hang_timeout_s}: shorter, a healthy peer whose process pauses briefly "
            f"(a garbage collection, a busy machine) is fenced, and every fence counts "
            f"towards its host's blacklist")
    if cfg.snapshot_every_s <= 0:
        raise ConfigError(f"snapshot_every_s must be positive, got {cfg.snapshot_every_s}")
    if cfg.snapshot_keep < 1:
        raise ConfigError(f"snapshot_keep must be at least 1, got {cfg.snapshot_keep}")
    if cfg.run_ttl_s < cfg.lease_ttl_s:
        raise ConfigError(f"run_ttl_s ({cfg.run_ttl_s}) must be at least lease_ttl_s "
                          f"({cfg.lease_ttl_s})")


def config_dict(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in JOB_FIELDS} | {"paused": cfg.paused}


assert {f.name for f in fields(JobSettings)} == set(_BY_NAME)
