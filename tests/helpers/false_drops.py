"""Crash-and-restart resets under CPU load, counting healthy members dropped.

Two healthy peers train with a third, the *victim*, which is SIGKILLed once it trains in a
world of 3 and then started again: every round is one reset whose dead member is confirmed
by a refused probe (peer_elastic/etcd/deaths.py). Meanwhile ``hogs`` busy-loop processes
compete for the CPUs. A healthy peer wrongly dropped shows as a lost lease / re-registration
in its log, or as a world smaller than 2 while both healthy peers run. At the end the job
stops through ``WORKER_END_FILE`` and the exactly-once oracle must hold.

:func:`run_resizes` makes resets without restarting anything, so hundreds fit in minutes:
three peers, ``max_np`` set to 2 (the youngest is parked, a reset) and back to 3 (it is
brought back, another reset), over and over under the same busy loops. Every member stays
healthy throughout, so any drop, lost lease or re-registration is a false one.

Used by tests/test_crash_detection.py (a few rounds) and benchmarks/bench_false_drops.py
(the issue's 200).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from peer_elastic.etcd.admin import update_config
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.view import JobView, ViewSnapshot
from tests.helpers.procs import Cluster, PeerProc
from tests.helpers.worker_lines import gen_lines, wait_world

DROPPED = re.compile(r"member \S+ lost its lease")  # logged once per loss (coordinator)


@dataclass
class ResetReport:
    """What :func:`run_resets` saw."""

    resets: int = 0
    false_drops: int = 0  # healthy peers dropped (must be 0)
    recovery_s: list[float] = field(default_factory=list)  # kill -> world of 2 seen
    exact: bool = False  # the exactly-once oracle held at the end
    notes: list[str] = field(default_factory=list)


def _gens(p: PeerProc) -> list[int]:
    return [g for g, _, _ in gen_lines(p)]


def _worlds(p: PeerProc) -> list[int]:
    return [size for _, _, size in gen_lines(p)]


def epoch_cap(resets: int, per_reset: int) -> int:
    """WORKER_EPOCHS for ``resets`` rounds: far more epochs than they take (the job is ended
    by WORKER_END_FILE). The oracle keeps a summary per epoch in the state, which every
    commit copies and every sync sends; a step trains one epoch's row whatever the cap."""
    return 4 * (50 + per_reset * resets)


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_resets(endpoint: str, job: str, resets: int, end_file: Path, hogs: int = 2,
               settings: dict[str, object] | None = None,
               say: Callable[[str], None] = lambda s: None) -> ResetReport:
    """Run ``resets`` crash-and-restart rounds (module docstring); processes are always
    stopped on the way out."""
    report = ResetReport()
    cluster = Cluster(endpoint, job, **{"PEER_ELASTIC_MIN_NP": 2,
                                        "WORKER_EPOCHS": epoch_cap(resets, per_reset=20),
                                        "WORKER_SAMPLES": 480, "WORKER_STEP_S": 0.02,
                                        "WORKER_END_FILE": end_file, **(settings or {})})
    hog_procs = start_hogs(hogs)
    try:
        healthy = cluster.start(2)
        for p in healthy:
            p.wait_line("GEN", timeout=120)
        for k in range(resets):
            (victim,) = cluster.start(1)
            wait_world(victim, 3, 180, seen=0)
            after = len(_worlds(healthy[0]))
            t0 = time.monotonic()
            victim.kill()
            wait_world(healthy[0], 2, 120, seen=after)
            report.recovery_s.append(time.monotonic() - t0)
            report.resets += 1
            say(f"reset {k + 1}/{resets}: world of 2 after {report.recovery_s[-1]:.2f} s")
        end_file.touch()
        for p in healthy:
            code = p.wait(300)
            if code != 0:
                report.notes.append(f"{p.name} exited {code}")
        for p in healthy:
            text = "\n".join(p.lines)
            report.false_drops += len(DROPPED.findall(text))
            if any(w < 2 for w in _worlds(p)[1:]):
                report.notes.append(f"{p.name} trained in a world below 2: {_worlds(p)}")
                report.false_drops += 1
        results = []
        for p in healthy:  # rank 0 prints it; the reader may still be draining the pipe
            try:
                results.append(json.loads(p.wait_line("RESULT ", timeout=10).split(" ", 1)[1]))
            except AssertionError:
                continue
        report.exact = bool(results) and all(r["exact"] and r["identical"] for r in results)
        if not report.exact:
            report.notes.append(f"oracle: {results or 'no RESULT line'}")
        return report
    finally:
        cluster.close()
        for h in hog_procs:
            h.kill()
            h.wait(10)


def _formed(size: int, after: int) -> Callable[[ViewSnapshot], bool]:
    """A generation newer than ``after`` with ``size`` members, all of them acknowledged."""
    def check(v: ViewSnapshot) -> bool:
        g = v.generation
        return g is not None and g.number > after and len(g.roster) == size \
            and set(g.roster) <= v.ready_for(g.number)
    return check


def run_resizes(endpoint: str, job: str, resets: int, end_file: Path, hogs: int = 2,
                say: Callable[[str], None] = lambda s: None) -> ResetReport:
    """``resets`` resets by resizing (module docstring): ``max_np`` 3 -> 2 -> 3 ...; processes
    are always stopped on the way out. ``recovery_s`` holds setting changed -> the new group
    trains (each of its members printed its GEN line)."""
    report = ResetReport()
    cluster = Cluster(endpoint, job, **{"PEER_ELASTIC_MIN_NP": 2, "PEER_ELASTIC_MAX_NP": 3,
                                        "WORKER_EPOCHS": epoch_cap(resets, per_reset=5),
                                        "WORKER_SAMPLES": 480,
                                        "WORKER_STEP_S": 0.02, "WORKER_END_FILE": end_file})
    client = EtcdClient(endpoint)
    view = JobView(client, job).start()
    hog_procs = start_hogs(hogs)
    try:
        peers = cluster.start(3)
        snap = view.wait_for(_formed(3, 0), 180)
        if snap is None:
            raise AssertionError("no world of 3:\n" + "\n".join(p.output() for p in peers))
        members = set(snap.generation.roster)
        for k in range(resets):
            size = 2 if k % 2 == 0 else 3
            t0 = time.monotonic()
            update_config(client, job, {"max_np": size}, requested_by="false-drops")
            snap = view.wait_for(_formed(size, snap.generation_number), 120)
            if snap is None:
                raise AssertionError(f"reset {k + 1}: no world of {size} in 120 s:\n"
                                     + "\n".join(p.output()[-3000:] for p in peers))
            n = snap.generation_number
            # The reset is done when the new group trains: as many peers printed GEN for it
            # (or later) as it has members.
            deadline = time.monotonic() + 120
            while len(behind := [p for p in peers if not any(g >= n for g in _gens(p))]) \
                    > len(peers) - size:
                if time.monotonic() > deadline:
                    raise AssertionError(f"reset {k + 1}: generation {n} never trained:\n"
                                         + "\n".join(p.output()[-3000:] for p in peers))
                try:  # the parked peer never prints it: wait briefly on each in turn
                    behind[k % len(behind)].wait_line("GEN", timeout=0.05,
                                                      after=len(behind[k % len(behind)].lines))
                except AssertionError:
                    pass
            report.recovery_s.append(time.monotonic() - t0)
            report.resets += 1
            gone = set(snap.members) ^ members
            if gone:  # a member key changed: someone was dropped or re-registered
                report.false_drops += len(gone)
                report.notes.append(f"reset {k + 1}: members changed: {sorted(gone)}")
                members = set(snap.members)
            say(f"reset {k + 1}/{resets}: world of {size} after {report.recovery_s[-1]:.2f} s")
        end_file.touch()
        for p in peers:
            code = p.wait(300)
            if code != 0:
                report.notes.append(f"{p.name} exited {code}")
        for p in peers:
            report.false_drops += len(DROPPED.findall("\n".join(p.lines)))
        results = []
        for p in peers:  # rank 0 prints it
            try:
                results.append(json.loads(p.wait_line("RESULT ", timeout=10).split(" ", 1)[1]))
            except AssertionError:
                continue
        report.exact = bool(results) and all(r["exact"] and r["identical"] for r in results)
        if not report.exact:
            report.notes.append(f"oracle: {results or 'no RESULT line'}")
        return report
    finally:
        cluster.close()
        view.stop()
        client.close()
        for h in hog_procs:
            h.kill()
            h.wait(10)
