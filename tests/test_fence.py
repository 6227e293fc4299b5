"""Fence records do not outlive their use: each has a lease of its own, so a long run that
fences many members does not keep every record (and every watcher read them all)."""

from __future__ import annotations

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.fence import MIN_FENCE_TTL_S, fence_member, fence_ttl_s
from peer_elastic.records import FenceCause

SETTINGS = JobSettings(start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3, join_timeout_s=1.0)


def test_a_fence_record_outlives_two_leaders_in_a_row_and_no_more() -> None:
    cfg = SETTINGS.resolved()
    assert fence_ttl_s(cfg) == MIN_FENCE_TTL_S
    cfg.lease_ttl_s, cfg.join_timeout_s = 60.0, 10.0
    assert fence_ttl_s(cfg) == pytest.approx(4 * 60 + 10 + cfg.settle_s)


def test_fence_records_end_with_their_own_lease_not_the_runs(etcd: str, unique_job: str) -> None:
    clients = [EtcdClient(etcd, retry_budget_s=10) for _ in range(4)]
    coords: list[Coordinator] = []
    try:
        for c in clients[:3]:
            coords.append(Coordinator(c, unique_job, SETTINGS).start())
        ids = {c.member_id for c in coords}
        watcher = coords[2]
        assert watcher.view.wait_for(lambda s: s.generation is not None
                                     and set(s.generation.roster) == ids, 15)
        run_lease = watcher.run.lease_id
        fenced = []
        for victim in coords[:2]:  # two fences in one run
            gone = victim.member_id
            assert fence_member(victim, FenceCause.FENCE_CAUSE_HUNG, "stuck").recorded
            snap = watcher.view.wait_for(lambda s, gone=gone: s.generation is not None
                                         and gone not in s.generation.roster, 15)
            assert snap is not None and "hung" in snap.generation.reason
            fenced.append(gone)
        observer = clients[3]
        for gone in fenced:
            kv = observer.get(watcher.keys.fenced(gone))
            assert kv is not None and kv.lease not in (0, run_lease), kv
            assert 0 < observer.lease_ttl(kv.lease) <= fence_ttl_s(watcher.config)
        # Once its lease ends, the record goes; the member stays out (its key went with the
        # fence) and the generation that named it stands.
        before = watcher.snapshot().generation.number
        for gone in fenced:
            observer.revoke(observer.get(watcher.keys.fenced(gone)).lease)
        snap = watcher.view.wait_for(lambda s: not s.fenced, 10)
        assert snap is not None
        assert all(g not in snap.members for g in fenced)
        assert [m.id for m in snap.eligible()] == [watcher.member_id]
        # No generation is caused by the records going.
        assert watcher.view.wait_for(lambda s: s.generation.number != before, 1.0) is None
    finally:
        for c in coords:
            c.close()
        for c in clients:
            c.close()
