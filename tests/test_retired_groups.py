"""RetiredGroups (peer_elastic.torch.gloo.retired_groups): a destroyed group stays referenced
until the next one is destroyed, and the last reference goes on a helper thread, never on
the caller's. On the real thing, the deadlock it avoids is a race (a gloo worker finishing
a collective while a DDP reducer frees the group): benchmarks/stop_storm.py reproduces it
in minutes under load, and every suite run with DDP rebuilt in reset callbacks
(test_elastic, test_schedules, test_chaos) runs through the retired groups."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from peer_elastic.torch.gloo.retired_groups import RetiredGroups


class Group:
    """Stands in for a ProcessGroup: records which thread freed it, and can be slow to."""

    def __init__(self, name: str, freed: dict[str, str], slow_s: float = 0.0) -> None:
        self.name, self.freed, self.slow_s = name, freed, slow_s

    def __del__(self) -> None:
        time.sleep(self.slow_s)  # a destructor waiting for gloo's worker threads
        self.freed[self.name] = threading.current_thread().name


def wait_freed(freed: dict[str, str], name: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while name not in freed and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return freed[name]


def test_a_retired_group_lives_until_the_next_is_retired() -> None:
    freed: dict[str, str] = {}
    retired = RetiredGroups()
    retired.retire(Group("g1", freed))
    gc.collect()
    assert freed == {} and len(retired) == 1  # the reset callbacks may drop DDP safely now
    retired.retire(Group("g2", freed))
    assert wait_freed(freed, "g1") == "peer-elastic-retired-groups"  # not this thread
    assert "g2" not in freed and len(retired) == 1


def test_retiring_never_waits_for_a_slow_destructor() -> None:
    freed: dict[str, str] = {}
    retired = RetiredGroups()
    retired.retire(Group("slow", freed, slow_s=1.0))
    t0 = time.monotonic()
    retired.retire(Group("next", freed))
    assert time.monotonic() - t0 < 0.5
    assert wait_freed(freed, "slow") == "peer-elastic-retired-groups"


def test_release_drops_everything_and_waits_a_bounded_time() -> None:
    freed: dict[str, str] = {}
    retired = RetiredGroups()
    retired.retire(Group("last", freed))
    assert retired.release(wait_s=10.0) is True
    assert freed["last"] == "peer-elastic-retired-groups" and len(retired) == 0
    retired.retire(Group("stuck", freed, slow_s=2.0))
    t0 = time.monotonic()
    assert retired.release(wait_s=0.2) is False  # gives up waiting, says so
    assert time.monotonic() - t0 < 1.5
    # Still running: a later release waits for it too (the process may exit after it).
    assert retired.release(wait_s=0.1) is False
    assert retired.release(wait_s=10.0) is True and freed["stuck"]
    assert retired.release(wait_s=0.0) is True  # nothing left


def test_release_waits_for_groups_dropped_by_earlier_retires() -> None:
    # close() retires the current group (which drops the previous generation's on a
    # helper) and then releases: the exit must not overtake that earlier helper.
    freed: dict[str, str] = {}
    retired = RetiredGroups()
    retired.retire(Group("older", freed, slow_s=1.0))
    retired.retire(Group("newer", freed))  # "older" goes on a helper, not waited for
    assert retired.release(wait_s=10.0) is True
    assert set(freed) == {"older", "newer"}


def test_none_is_not_kept() -> None:
    retired = RetiredGroups()
    retired.retire(None)
    assert len(retired) == 0


def test_a_generations_groups_are_kept_and_dropped_together() -> None:
    # The default group and its subgroups (a DDP wrapper may reduce over a subgroup).
    freed: dict[str, str] = {}
    retired = RetiredGroups()
    retired.retire(Group("world1", freed), None, Group("sub1", freed))
    gc.collect()
    assert freed == {} and len(retired) == 2
    retired.retire(Group("world2", freed))
    assert wait_freed(freed, "world1") == "peer-elastic-retired-groups"
    assert wait_freed(freed, "sub1") == "peer-elastic-retired-groups"
    assert len(retired) == 1


def test_known_groups_are_what_destroy_process_group_destroys() -> None:
    # A real gloo group with a user subgroup: known_groups() lists what
    # destroy_process_group() is about to destroy, the default group first or not.
    import socket

    import torch.distributed as dist

    from peer_elastic.torch.group import known_groups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        groups = known_groups()
        assert dist.group.WORLD in groups and sub in groups and len(groups) == 2
    finally:
        dist.destroy_process_group()
    assert [g for g in known_groups() if g is not None] == []


@pytest.mark.slow
def test_a_destructor_ending_during_exit_does_not_abort_the_process(tmp_path) -> None:
    # Real gloo, two processes: the group's destructor is still waiting on a helper thread
    # for its collective when rank 0 returns from main; the collective ends only once rank 0
    # is exiting. The exit waits for the helper, so rank 0 exits 0 (it died of SIGABRT in
    # CI when the destructor returned into a finalizing interpreter).
    import subprocess
    import sys

    store, exiting = tmp_path / "store", tmp_path / "exiting"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.retired_group_exit",
                               str(rank), str(store), str(exiting)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert "RELEASED False" in outs[0], outs[0]  # it did not wait there: the exit did
    assert "RANK1 DONE" in outs[1], outs[1]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "terminate called" not in outs[0], outs[0]
