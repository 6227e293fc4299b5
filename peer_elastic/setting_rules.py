"""The rules every job's settings must satisfy: one function for local and etcd settings.

A peer checks the settings it was given (:func:`peer_elastic.config.validate`) and the
settings it reads from the run record in etcd (:mod:`peer_elastic.records`) with the same
rules, so a value that no peer may be started with cannot be written into etcd either
(a ``hang_timeout_s`` of 0.05, a negative timeout, a lease of a year). Each caller turns a
:class:`SettingProblem` into its own error type.

Nothing here imports anything heavier than the generated protobuf module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer_elastic.proto.records_pb2 import JobConfig
from peer_elastic.settings_table import JOB_SETTINGS
from peer_elastic.straggler.settings import StragglerPolicy

__all__ = ["MAX_DURATION_S", "MAX_PEERS", "MIN_HANG_TIMEOUT_S", "SettingProblem",
           "setting_problem"]

#: No duration setting may exceed this: a larger one disables a timeout, or a lease, in
#: all but name.
MAX_DURATION_S = 366 * 86400.0
#: Most peers a job may ask for (min_np, max_np).
MAX_PEERS = 1_000_000
#: The shortest hang_timeout_s other than 0 (off). The hang monitor starts the clock afresh
#: when it wakes this much later than planned (peer_elastic.liveness.FREEZE_SLACK_S): below
#: it, a pause of the whole process would be blamed on the training thread, and healthy
#: peers would be fenced between two ordinary steps.
MIN_HANG_TIMEOUT_S = 1.0

_FLOATS = tuple(f for f in JOB_SETTINGS if f.kind is float)
_POSITIVE = ("join_timeout_s", "elastic_timeout_s", "blacklist_cooldown_s", "run_ttl_s",
             "snapshot_every_s", "straggler_window_s", "straggler_cooldown_s")
_POLICIES = tuple(p.value for p in StragglerPolicy)
_NOT_NEGATIVE = ("settle_s", "start_settle_s", "hang_first_step_s")


@dataclass(frozen=True)
class SettingProblem:
    """Why a job configuration cannot run: the setting at fault and, for a person, why."""

    setting: str
    why: str

    def __str__(self) -> str:
        return self.why


def setting_problem(cfg: JobConfig) -> SettingProblem | None:
    """The first rule ``cfg`` breaks, or None when every setting is one a job can run with."""
    for f in _FLOATS:
        value = getattr(cfg, f.name)
        # NaN passes every comparison below (all are False), and inf disables a timeout or
        # a lease silently: neither is a setting anyone means.
        if not math.isfinite(value):
            return SettingProblem(f.name, f"{f.name} must be a finite number, got {value} "
                                          f"({f.env})")
        if value > MAX_DURATION_S:
            return SettingProblem(f.name, f"{f.name} must be at most {MAX_DURATION_S:.0f} s "
                                          f"(a year), got {value} ({f.env})")
    if cfg.min_np < 1:
        return SettingProblem("min_np", f"min_np must be at least 1, got {cfg.min_np}")
    if cfg.min_np > MAX_PEERS or cfg.max_np > MAX_PEERS:
        return SettingProblem("max_np" if cfg.max_np > MAX_PEERS else "min_np",
                              f"min_np and max_np must be at most {MAX_PEERS}, got "
                              f"{cfg.min_np} and {cfg.max_np}")
    if cfg.max_np and cfg.max_np < cfg.min_np:
        return SettingProblem("max_np", f"max_np ({cfg.max_np}) is smaller than min_np "
                                        f"({cfg.min_np})")
    if cfg.lease_ttl_s < 1:
        return SettingProblem("lease_ttl_s", f"lease_ttl_s must be at least 1 s (etcd grants "
                                             f"whole seconds), got {cfg.lease_ttl_s}")
    for name in _POSITIVE:
        if getattr(cfg, name) <= 0:
            return SettingProblem(name, f"{name} must be positive, got {getattr(cfg, name)}")
    for name in _NOT_NEGATIVE:
        if getattr(cfg, name) < 0:
            return SettingProblem(name, f"{name} must not be negative, got "
                                        f"{getattr(cfg, name)}")
    if cfg.hang_timeout_s != 0 and cfg.hang_timeout_s < MIN_HANG_TIMEOUT_S:
        return SettingProblem("hang_timeout_s",
                              f"hang_timeout_s must be 0 (off) or at least "
                              f"{MIN_HANG_TIMEOUT_S:.0f} s, got {cfg.hang_timeout_s}: "
                              f"shorter, a healthy peer whose process pauses briefly (a "
                              f"garbage collection, a busy machine) is fenced, and every "
                              f"fence counts towards its host's blacklist")
    if cfg.snapshot_keep < 1:
        return SettingProblem("snapshot_keep",
                              f"snapshot_keep must be at least 1, got {cfg.snapshot_keep}")
    if cfg.straggler_policy not in _POLICIES:
        return SettingProblem("straggler_policy",
                              f"straggler_policy must be one of {', '.join(_POLICIES)}, got "
                              f"{cfg.straggler_policy!r}")
    if cfg.straggler_threshold <= 1:
        return SettingProblem("straggler_threshold",
                              f"straggler_threshold must be above 1 (a score of 1 is the "
                              f"group's own pace), got {cfg.straggler_threshold}")
    if cfg.run_ttl_s < cfg.lease_ttl_s:
        return SettingProblem("run_ttl_s", f"run_ttl_s ({cfg.run_ttl_s}) must be at least "
                                           f"lease_ttl_s ({cfg.lease_ttl_s})")
    return None
