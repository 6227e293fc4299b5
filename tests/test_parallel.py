"""The suite's run over several workers (tests/helpers/parallel.py): a test marked ``alone``
runs with no other test at the same time, and the others share the machine."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.helpers.parallel import MAX_WORKERS, RunLock, auto_workers

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 30.0


def test_auto_workers_is_one_per_core_up_to_the_maximum() -> None:
    assert auto_workers(1) == 1
    assert auto_workers(2) == min(2, MAX_WORKERS)
    assert auto_workers(64) == MAX_WORKERS


class Holder:
    """A thread holding ``lock`` (its own open files: flock locks of separate opens conflict
    as between processes) from when it gets it until ``release`` is set."""

    def __init__(self, lock: RunLock, alone: bool) -> None:
        self.got = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(lock, alone), daemon=True)
        self.thread.start()

    def _run(self, lock: RunLock, alone: bool) -> None:
        with lock.hold(alone):
            self.got.set()
            self.release.wait(WAIT_S)

    def end(self) -> None:
        self.release.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def test_shared_holders_run_together(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    a, b = Holder(lock, alone=False), Holder(lock, alone=False)
    assert a.got.wait(WAIT_S) and b.got.wait(WAIT_S)
    a.end()
    b.end()


def test_a_test_alone_waits_for_the_running_ones_and_keeps_later_ones_out(
        tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    running = Holder(lock, alone=False)
    assert running.got.wait(WAIT_S)
    alone = Holder(lock, alone=True)
    assert not alone.got.wait(0.3)  # the running test still holds the lock
    later = Holder(lock, alone=False)
    assert not later.got.wait(0.3)  # queued behind the one waiting to run alone
    running.end()
    assert alone.got.wait(WAIT_S)
    assert not later.got.wait(0.3)  # still alone
    alone.end()
    assert later.got.wait(WAIT_S)
    later.end()


INNER_TEST = """
import json, os, time
import pytest

def record(tmp_path_factory, name):
    log = tmp_path_factory.getbasetemp().parent / "intervals.jsonl"
    t0 = time.monotonic()
    time.sleep(1.0)
    with open(log, "a") as f:
        f.write(json.dumps([name, t0, time.monotonic(), os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.mark.alone
def test_alone(tmp_path_factory):
    record(tmp_path_factory, "alone")

@pytest.mark.parametrize("i", range(6))
def test_shared(tmp_path_factory, i):
    record(tmp_path_factory, f"shared{i}")

@pytest.mark.slow
def test_long(tmp_path_factory):
    record(tmp_path_factory, "long")
"""


@pytest.mark.slow
def test_a_run_over_two_workers_keeps_an_alone_test_alone(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real hooks (conftest.py) in a run over two xdist workers, scheduled as the suite
    # is (one test at a time): the shared tests overlap one another; the slow test runs
    # first (the file has it last); the one marked alone runs with no other test beside it,
    # and last on its worker. Not necessarily after every other test: the other worker may
    # hold one test it was handed before, which waits for the alone test to end.
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    alone: runs alone\n    slow: long\n")
    pytester.makepyfile(test_inner=INNER_TEST)
    # The inner run starts in a temp dir: let it import the helpers from this checkout.
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), pythonpath) if p))
    base = pytester.path / "base"
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "load", "--maxschedchunk", "1",
                                           "-p", "no:cacheprovider", f"--basetemp={base}",
                                           timeout=120)
    result.assert_outcomes(passed=8)
    rows = [json.loads(line) for line in (base / "intervals.jsonl").read_text().splitlines()]
    (alone,) = [(t0, t1) for name, t0, t1, _ in rows if name == "alone"]
    (alone_worker,) = [w for name, *_, w in rows if name == "alone"]
    shared = [(t0, t1) for name, t0, t1, _ in rows if name != "alone"]
    assert len({w for *_, w in rows}) == 2, rows  # both workers ran tests
    assert all(t1 <= alone[0] or t0 >= alone[1] for t0, t1 in shared), rows  # none beside it
    assert max((t0, name) for name, t0, _, w in rows if w == alone_worker)[1] == "alone", rows
    (long_worker,) = [w for name, *_, w in rows if name == "long"]
    assert min((t0, name) for name, t0, _, w in rows if w == long_worker)[1] == "long", rows
    assert any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(shared)
               for b0, b1 in shared[i + 1:]), rows  # the others did run side by side
