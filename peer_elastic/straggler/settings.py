"""The straggler settings of a job, typed: what the four job settings say.

``straggler_policy`` (``off``, ``report``, ``evict``), ``straggler_threshold``,
``straggler_window_s`` and ``straggler_cooldown_s`` are job settings like any other
(:mod:`peer_elastic.settings_table`, changeable with ``peer-elastic set``); the rules they
obey are in :mod:`peer_elastic.setting_rules`. A peer reads them from its coordinator's
config, the watched run record, at every exchange, so a change applies within about a
second.

Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["StragglerPolicy", "StragglerSettings"]


class StragglerPolicy(enum.Enum):
    """What a peer does once it has been a straggler for the whole window."""

    OFF = "off"  # nothing: scores are still measured and shown
    REPORT = "report"  # a ``straggler`` event, once per episode
    EVICT = "evict"  # the event, and it leaves the job gracefully when that is allowed


@dataclass(frozen=True)
class StragglerSettings:
    policy: StragglerPolicy = StragglerPolicy.REPORT
    threshold: float = 2.0
    window_s: float = 60.0
    cooldown_s: float = 60.0

    @classmethod
    def of(cls, config: Any) -> StragglerSettings:
        """The settings of a job config (a ``JobConfig``: validated, so the policy is one
        of :class:`StragglerPolicy`'s values)."""
        return cls(StragglerPolicy(config.straggler_policy), config.straggler_threshold,
                   config.straggler_window_s, config.straggler_cooldown_s)
