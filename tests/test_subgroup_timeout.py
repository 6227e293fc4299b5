"""Groups the training script makes without a timeout get the job's collective timeout
(peer_elastic.torch.gloo.subgroup_timeout); the real peer woken past its lease with a send gloo
queued is in tests/test_abort.py (the subgroup tests' victim comes back)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from peer_elastic.torch.gloo.subgroup_timeout import (
    bound_default_timeouts,
    restore_default_timeouts,
)


def test_new_groups_default_to_the_job_timeout_until_restored() -> None:
    c10d = dist.distributed_c10d
    before = c10d.default_pg_timeout
    previous = bound_default_timeouts(7.5)
    try:
        assert c10d.default_pg_timeout == timedelta(seconds=7.5)
        # what dist.new_group() reads when it is given no timeout
        assert c10d._get_default_timeout(dist.Backend.GLOO) == timedelta(seconds=7.5)
    finally:
        restore_default_timeouts(previous)
    assert c10d.default_pg_timeout == before
