"""Thousands of seeded schedules of the per-step protocol against the agreement rule.

The model lives in ``tests/helpers/protocol_sim.py``; the rule is the real
``peer_elastic.state.agreement.agree``. The real multi-process runs are in ``test_schedules.py``.
Replay one seed with ``run_schedule(seed)``; it raises with the schedule's events.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.helpers.protocol_sim import Recording, Rule, Violation, run_schedule

SEEDS = int(os.environ.get("PEER_ELASTIC_SIM_SEEDS", "1500"))


@pytest.mark.parametrize("recording", list(Recording))
def test_every_schedule_trains_every_sample_exactly_once(recording: Recording) -> None:
    base = random.SystemRandom().randrange(10**9)
    print(f"simulation seeds {base}..{base + SEEDS - 1} ({recording.value})")
    resets = 0
    for seed in range(base, base + SEEDS):
        resets += run_schedule(seed, recording=recording).resets
    assert resets > SEEDS  # the schedules really did reset


@pytest.mark.parametrize("recording", list(Recording))
def test_the_old_rule_is_caught(recording: Recording) -> None:
    # The model has teeth: the rule before issue 9 (commit count decides, progress OR-merged
    # at sync, no merge before a reset) breaks the contract in some schedules.
    failures = 0
    for seed in range(2000):
        try:
            run_schedule(seed, rule=Rule.OLD, recording=recording)
        except Violation:
            failures += 1
    assert failures > 0
