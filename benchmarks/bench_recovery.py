"""Recovery time: peer-elastic vs torchrun, side by side in one run.

Each scenario starts a fresh 3-member job, lets it train ``--warmup`` steps, applies one
event, waits until the re-formed group has trained ``--after`` more steps, then stops every
process it started (and checks that none is left). Both systems train the same MLP on the
same synthetic data (``recovery_worker.py``), about 20 ms per step here.

Systems:

* ``peer-elastic``: 3 peers (``recovery_worker.py``) meeting in an etcd that this script
  starts on loopback; every peer-elastic timing setting at its default
  (``min_np=2``, ``max_np=4`` are the job's shape). ``peer-elastic-tuned``: the same with
  ``lease_ttl_s=2``, ``join_timeout_s=0.5``.
* ``torchrun-tuned`` / ``torchrun-default``: one torchrun agent per member
  (``--nnodes=2:3``, ``3:4`` for the join scenario, ``--nproc-per-node=1``, c10d rendezvous
  on ``127.0.0.1:<free port>``, ``--max-restarts=10``), running ``torchrun_worker.py``
  (DDP; rank 0 checkpoints every ``--ckpt-every`` steps, workers resume from that file).
  Agent 0 hosts the c10d store (``is_host=true``; the others ``is_host=false``).
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set for both (with gloo, restarted workers
  otherwise read stale addresses and fail). Tuned adds
  ``--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``.
* ``torchrun-pe`` / ``torchrun-pe-tuned``: the same agents, worker and checkpoints, with
  peer-elastic's torchrun rendezvous instead of c10d (``--rdzv-backend=peer-elastic``,
  ``--rdzv-endpoint`` = the etcd this script starts); no agent is special, so the "leader"
  is the agent of group rank 0 (the oldest). Default: the plugin's defaults (``lease_ttl=5``,
  ``last_call_timeout=2``, ``settle=0.3``); tuned: ``lease_ttl=3,last_call_timeout=1`` (the
  3 s failure detection and 1 s last call of torchrun-tuned).

Scenarios (the member hit is chosen from the workers' own output):

* ``kill-worker``: SIGKILL of a member that is not the leader (peer-elastic: not rank 0,
  which is the oldest member; torchrun: an agent that neither hosts the c10d store nor runs
  rank 0). torchrun's agent and its worker are killed together (a node crash); a
  peer-elastic peer is one process.
* ``kill-leader``: SIGKILL of the leader (peer-elastic: rank 0 = the oldest member;
  torchrun: the agent hosting the c10d store, with its worker; torchrun-pe: the agent of
  group rank 0, with its worker).
* ``sigterm``: SIGTERM of one non-leader member (peer-elastic: the peer, which leaves
  gracefully; torchrun: the agent, as ``kill <pid>`` of a launcher).
* ``hang``: SIGSTOP of the training process of a non-leader member, which stays stopped:
  a peer hung inside a collective (a stuck host, swapping, a debugger). peer-elastic: the
  peer; torchrun: its worker (the agent goes on answering the rendezvous). Both groups'
  collective timeout is 30 s (peer-elastic's default; the torchrun worker passes
  ``timeout=30 s``, since torch's own default for gloo is 30 min). Any world of 2 or 3
  counts as the new group: torchrun's agent may start a replacement worker.
  ``peer-elastic-no-abandon`` (selectable with ``--systems``) is peer-elastic with
  ``PEER_ELASTIC_ABANDON_COLLECTIVES=0``: what the hang costs without abandoning the stuck
  collective.
* ``join``: a 4th member starts. The event time is when the joiner is ready to join: the
  ``READY`` line of a peer-elastic peer (printed after its imports and model, right before
  ``pe.join()``), or, for torchrun, the agent's ``AGENT`` line (printed after
  ``import torch.distributed.run``, right before its ``main``). Both exclude the joiner's
  Python start and torch import.

Measured per scenario, from the lines the workers print (``STEP <step> <unix time> <group>
<rank> <world> <pid>``, wall clock, one machine):

* new group: the first group (peer-elastic generation / torchrun rank-0 pid) seen only
  after the event, with the expected world size (2 after a departure, 4 after the join);
* ``recovery_all_s``: event -> the moment every rank of the new group has completed a step
  (the headline); ``recovery_first_s``: event -> its first completed step;
* ``stall_s``: last step completed by the old group -> first step of the new group (how
  long training made no progress at all; for a join/leave the old group trains on until
  the reset);
* ``redone_steps``: (last step number completed before the new group's first step)
  - (first step number of the new group) + 1, clipped at 0;
* ``job_ended``: every process exited instead (``ended_s``: event -> the last one gone).

Usage::

    python benchmarks/bench_recovery.py --out results.json           # everything (~10-12 min)
    python benchmarks/bench_recovery.py --quick --out quick.json     # peer-elastic + tuned
    python benchmarks/bench_recovery.py --systems peer-elastic --scenarios kill-leader
    python benchmarks/bench_recovery.py --systems torchrun-tuned,torchrun-pe,torchrun-pe-tuned \
        --scenarios kill-worker,kill-leader,sigterm,join --repeat 3     # the rendezvous backends
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PE_WORKER = HERE / "recovery_worker.py"
TR_WORKER = HERE / "torchrun_worker.py"
TFT_WORKER = HERE / "torchft_worker.py"

SCENARIOS = ("kill-worker", "kill-leader", "sigterm", "join", "hang")
SYSTEMS = ("peer-elastic", "peer-elastic-tuned", "torchrun-tuned", "torchrun-default",
           "torchrun-pe")
ALL_SYSTEMS = (*SYSTEMS, "peer-elastic-no-abandon", "torchrun-pe-tuned", "torchft",
               "torchft-tuned")
#: torchft 0.2.0 (installed separately: see TORCHFT_INSTALL).
TORCHFT = ("torchft", "torchft-tuned")
TORCHFT_INSTALL = ("pip install --no-deps torchft==0.2.0 && pip install opentelemetry-api "
                   "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http")
#: torchft-tuned: the Lighthouse declares a replica dead after 1 s without a heartbeat
#: (default 5 s) and waits at most 1 s for stragglers before issuing a quorum (default 60 s);
#: the managers' collective/RPC timeout is 5 s and their quorum timeout 10 s (default 60 s).
TFT_LIGHTHOUSE_TUNED = ("--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "1000")
TFT_ENV_TUNED = {"BENCH_TFT_TIMEOUT_S": "5", "BENCH_TFT_QUORUM_TIMEOUT_S": "10"}
#: torchrun with peer-elastic's rendezvous (--rdzv-backend=peer-elastic) instead of c10d.
TORCHRUN_PE = ("torchrun-pe", "torchrun-pe-tuned")
QUICK_SCENARIOS = ("kill-worker", "sigterm", "join")
QUICK_SYSTEMS = ("peer-elastic", "torchrun-tuned")

TUNED_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
PE_RDZV_TUNED = "lease_ttl=3,last_call_timeout=1"
PE_TUNED = {"PEER_ELASTIC_LEASE_TTL": "2", "PEER_ELASTIC_JOIN_TIMEOUT": "0.5"}

#: Targets from the issue: join and graceful leave within 0.5 s with no work re-done, a
#: crash of any peer within 2 s at default settings, >= 3x tuned and >= 20x default torchrun.
TARGET_GRACEFUL_S = 0.5
TARGET_CRASH_S = 2.0
TARGET_VS_TUNED = 3.0
TARGET_VS_DEFAULT = 20.0
#: A peer hung in a collective: the survivors re-form within about the lease TTL (5 s) plus
#: join_timeout (1 s) at default settings, plus the reset itself.
TARGET_HANG_S = 5.0 + 1.0 + 2.0

START_TIMEOUT_S = 150.0  # torchrun's default last call alone is 30 s
RECOVERY_TIMEOUT_S = {"peer-elastic": 60.0, "peer-elastic-tuned": 60.0,
                      "peer-elastic-no-abandon": 90.0,
                      "torchrun-tuned": 120.0, "torchrun-default": 180.0,
                      "torchrun-pe": 120.0, "torchrun-pe-tuned": 120.0,
                      "torchft": 120.0, "torchft-tuned": 90.0}
ENDED_TIMEOUT_S = 120.0

AGENT_BOOT = ("import sys, time; import torch.distributed.run as r; "
              "print('AGENT', f'{time.time():.6f}', flush=True); r.main(sys.argv[1:])")


# --- parsed output -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    step: int
    t: float
    group: int
    rank: int
    world: int
    pid: int
    member: int


@dataclass(frozen=True)
class Group:
    group: int
    rank: int
    world: int
    pid: int
    ppid: int
    t: float
    member: int


class Member:
    """One process we started (a peer-elastic peer or a torchrun agent), its output parsed
    by a reader thread. torchrun workers inherit their agent's stdout, so their lines land
    in the agent's member."""

    def __init__(self, index: int, args: list[str], env: dict[str, str], log_dir: Path | None,
                 name: str) -> None:
        self.index = index
        self.name = name
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.steps: list[Step] = []
        self.groups: list[Group] = []
        self.ready_t: float | None = None
        self.started_t = time.time()
        self.exited_t: float | None = None
        self._log = open(log_dir / f"{name}.log", "w") if log_dir else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if self._log:
                self._log.write(line + "\n")
            parts = line.split()
            with self.lock:
                self.lines.append(line)
                try:
                    if parts[:1] == ["STEP"] and len(parts) >= 7:
                        self.steps.append(Step(int(parts[1]), float(parts[2]), int(parts[3]),
                                               int(parts[4]), int(parts[5]), int(parts[6]),
                                               self.index))
                    elif parts[:1] == ["GROUP"] and len(parts) >= 7:
                        self.groups.append(Group(int(parts[1]), int(parts[2]), int(parts[3]),
                                                 int(parts[4]), int(parts[5]), float(parts[6]),
                                                 self.index))
                    elif parts[:1] in (["READY"], ["AGENT"]) and self.ready_t is None:
                        self.ready_t = float(parts[1])
                except ValueError:
                    pass  # an interleaved or foreign line: keep it in lines only
        self.proc.wait()
        self.exited_t = time.time()
        if self._log:
            self._log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        with self.lock:
            return "\n".join(self.lines[-n:])

    def current_group(self) -> Group | None:
        with self.lock:
            return self.groups[-1] if self.groups else None


# --- processes ------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    """ppid -> child pids of every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields_ = stat[stat.rfind(")") + 2:].split()
        out.setdefault(int(fields_[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first)."""
    kids = _children()
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _state(pid: int) -> str | None:
    """The process state letter of ``pid``, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def tagged_pids(tag: str) -> list[int]:
    """Live processes of this user whose environment carries ``BENCH_TAG=tag``."""
    needle = f"BENCH_TAG={tag}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and alive(int(entry)):
            out.append(int(entry))
    return out


def killpg_quiet(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid``'s process group and the groups of all its descendants, at once.

    The tree is frozen first (SIGSTOP), so a torchrun agent cannot start a new worker
    between the listing and the kill. Returns the pids that were hit.
    """
    killpg_quiet(pid, signal.SIGSTOP)
    tree = [pid, *descendants(pid)]
    for p in tree:
        killpg_quiet(p, signal.SIGKILL)
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


# --- jobs -----------------------------------------------------------------------------------------


class Job:
    """A set of members of one system; subclasses know how to start one."""

    system = ""

    def __init__(self, tag: str, log_dir: Path | None, env: dict[str, str]) -> None:
        self.tag = tag
        self.log_dir = log_dir
        self.env = dict(env, BENCH_TAG=tag, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.members: list[Member] = []

    def command(self, index: int) -> list[str]:
        raise NotImplementedError

    def start(self) -> Member:
        i = len(self.members)
        m = Member(i, self.command(i), self.member_env(i), self.log_dir,
                   f"{self.system}-{self.tag}-m{i}")
        self.members.append(m)
        return m

    def member_env(self, index: int) -> dict[str, str]:
        return self.env

    def steps(self) -> list[Step]:
        out: list[Step] = []
        for m in self.members:
            with m.lock:
                out.extend(m.steps)
        out.sort(key=lambda s: s.t)
        return out

    def leader(self) -> Member:
        raise NotImplementedError

    def non_leader(self) -> Member:
        raise NotImplementedError

    def crash(self, m: Member) -> list[int]:
        """A machine crash of member ``m``: it and everything it started, SIGKILL at once."""
        return kill_tree(m.pid)

    def close(self) -> dict[str, Any]:
        """Kill everything; report what had to be killed and what (if anything) survived."""
        seen: set[int] = set()
        for m in self.members:
            seen.add(m.pid)
            with m.lock:
                seen.update(g.pid for g in m.groups)
            if m.alive():
                seen.update(kill_tree(m.pid))
        for m in self.members:
            try:
                m.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        left = [p for p in seen if alive(p)] + tagged_pids(self.tag)
        while left and time.monotonic() < deadline:
            for p in left:
                killpg_quiet(p, signal.SIGKILL)
            time.sleep(0.2)
            left = [p for p in seen if alive(p)] + tagged_pids(self.tag)
        return {"pids_seen": len(seen), "leftovers": sorted(set(left))}


def _rank_holder(job: Job, rank: int) -> Member | None:
    """The member whose latest group line has ``rank`` in the newest group."""
    newest = max((m.current_group() for m in job.members if m.current_group()),
                 key=lambda g: g.t, default=None)
    if newest is None:
        return None
    for m in job.members:
        g = m.current_group()
        if g is not None and g.group == newest.group and g.rank == rank and m.alive():
            return m
    return None


class PeerElasticJob(Job):
    system = "peer-elastic"

    def __init__(self, tag: str, log_dir: Path | None, endpoint: str, system: str) -> None:
        env = dict(os.environ, PEER_ELASTIC_ETCD=endpoint, PEER_ELASTIC_JOB=f"bench-{tag}",
                   PEER_ELASTIC_MIN_NP="2", PEER_ELASTIC_MAX_NP="4")
        for k in ("PEER_ELASTIC_LEASE_TTL", "PEER_ELASTIC_JOIN_TIMEOUT", "PEER_ELASTIC_SETTLE",
                  "PEER_ELASTIC_START_SETTLE", "PEER_ELASTIC_COLLECTIVE_TIMEOUT",
                  "PEER_ELASTIC_ABANDON_COLLECTIVES"):
            env.pop(k, None)  # defaults, whatever the caller's environment says
        if system == "peer-elastic-tuned":
            env.update(PE_TUNED)
        elif system == "peer-elastic-no-abandon":
            env["PEER_ELASTIC_ABANDON_COLLECTIVES"] = "0"
        self.system = system
        super().__init__(tag, log_dir, env)

    def command(self, index: int) -> list[str]:
        return [sys.executable, str(PE_WORKER)]

    def leader(self) -> Member:
        m = _rank_holder(self, 0)
        assert m is not None, "no rank 0"
        return m

    def non_leader(self) -> Member:
        for rank in range(8, 0, -1):
            m = _rank_holder(self, rank)
            if m is not None:
                return m
        raise AssertionError("no member with rank > 0")


class TorchrunJob(Job):
    """torchrun agents with the c10d rendezvous (``torchrun-tuned`` / ``-default``) or with
    peer-elastic's (``torchrun-pe`` / ``-pe-tuned``, on ``endpoint``)."""

    def __init__(self, tag: str, log_dir: Path | None, system: str, nnodes: str,
                 ckpt_dir: Path, ckpt_every: int, max_restarts: int,
                 endpoint: str | None = None) -> None:
        from peer_elastic.etcd_server import free_port

        self.system = system
        self.pe = system in TORCHRUN_PE
        if self.pe and not endpoint:
            raise ValueError(f"{system} needs an etcd endpoint")
        self.endpoint = endpoint if self.pe else f"127.0.0.1:{free_port()}"
        self.tuned = system.endswith("tuned")
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   BENCH_CKPT=str(ckpt_dir / f"ckpt-{tag}.pt"), BENCH_CKPT_EVERY=str(ckpt_every))
        for k in [k for k in env if k.startswith("PEER_ELASTIC_")]:
            env.pop(k)  # the plugin's settings come from --rdzv-conf only
        super().__init__(tag, log_dir, env)

    def command(self, index: int) -> list[str]:
        if self.pe:
            backend = "peer-elastic"
            conf = PE_RDZV_TUNED if self.tuned else ""
        else:
            backend = "c10d"
            conf = f"is_host={'true' if index == 0 else 'false'}"
            if self.tuned:
                conf += "," + TUNED_RDZV
        return [
            sys.executable, "-c", AGENT_BOOT,
            f"--nnodes={self.nnodes}", "--nproc-per-node=1",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id=bench-{self.tag}", *([f"--rdzv-conf={conf}"] if conf else []),
            f"--max-restarts={self.max_restarts}", str(TR_WORKER),
        ]

    def leader(self) -> Member:
        if self.pe:  # no store host: the agent of group rank 0 (the oldest)
            m = _rank_holder(self, 0)
            assert m is not None, "no rank 0"
            return m
        return self.members[0]  # the c10d store host

    def non_leader(self) -> Member:
        rank0 = _rank_holder(self, 0)
        for m in self.members[0 if self.pe else 1:]:
            if m is not rank0 and m.alive():
                return m
        raise AssertionError("no agent that is neither the store host nor rank 0")


class TorchftJob(Job):
    """torchft replicas (``torchft_worker.py``, one process = one replica group of one rank)
    meeting through a Lighthouse that this job starts on loopback (``--min_replicas 2``, so
    the job goes on with 2 after a departure). The Lighthouse runs on member 0's "host":
    ``kill-leader`` crashes both, as a machine crash would; the other scenarios leave it be.
    """

    def __init__(self, tag: str, log_dir: Path | None, system: str) -> None:
        from peer_elastic.etcd_server import free_port

        self.system = system
        port = free_port()
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")
        for k in [k for k in env if k.startswith(("PEER_ELASTIC_", "TORCHFT_"))
                  and k != "TORCHFT_LIGHTHOUSE"]:
            env.pop(k)
        if system == "torchft-tuned":
            env.update(TFT_ENV_TUNED)
        super().__init__(tag, log_dir, env)
        binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) \
            or shutil.which("torchft_lighthouse")
        if binary is None:
            raise RuntimeError(f"torchft_lighthouse not found: {TORCHFT_INSTALL}")
        tuned = TFT_LIGHTHOUSE_TUNED if system == "torchft-tuned" else ()
        self.lighthouse = Member(-1, [binary, "--bind", f"127.0.0.1:{port}",
                                     "--min_replicas", "2", *tuned], self.env, log_dir,
                                 f"{system}-{tag}-lighthouse")

    def command(self, index: int) -> list[str]:
        return [sys.executable, str(TFT_WORKER)]

    def member_env(self, index: int) -> dict[str, str]:
        return dict(self.env, BENCH_REPLICA=str(index))

    def leader(self) -> Member:
        return self.members[0]  # beside the Lighthouse

    def non_leader(self) -> Member:
        for m in self.members[1:]:
            if m.alive() and m.current_group() is not None:
                return m
        raise AssertionError("no replica besides the Lighthouse's")

    def crash(self, m: Member) -> list[int]:
        hit = kill_tree(m.pid)
        if m is self.members[0]:
            hit += kill_tree(self.lighthouse.pid)  # the same machine
        return hit

    def close(self) -> dict[str, Any]:
        if self.lighthouse.alive():
            kill_tree(self.lighthouse.pid)
        try:
            self.lighthouse.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return super().close()


def torchft_available() -> str | None:
    """None if torchft can be imported, else why not (with the install command)."""
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # ImportError, or its opentelemetry imports
        return f"torchft is not importable ({exc}); install it with: {TORCHFT_INSTALL}"
    return None


# --- one scenario ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    system: str
    scenario: str
    ok: bool = False
    error: str | None = None
    recovery_all_s: float | None = None
    recovery_first_s: float | None = None
    stall_s: float | None = None
    redone_steps: int | None = None
    job_ended: bool = False
    ended_s: float | None = None
    step_s: float | None = None  # median step time before the event
    event_at_step: int | None = None
    new_group: int | None = None
    new_world: int | None = None
    first_new_step: int | None = None
    last_old_step: int | None = None
    intermediate_groups: int = 0
    target_member: str = ""
    target_exit: int | None = None
    target_exit_s: float | None = None  # event -> the signalled member's process exited
    target_rank: int | None = None
    leftovers: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def wait_until(cond: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return cond()


def _by_group(steps: list[Step]) -> dict[int, list[Step]]:
    out: dict[int, list[Step]] = {}
    for s in steps:
        out.setdefault(s.group, []).append(s)
    return out


def _warm(job: Job, world: int, warmup: int) -> bool:
    for steps in _by_group(job.steps()).values():
        if steps[0].world == world and len({s.rank for s in steps}) == world and \
                max(s.step for s in steps) >= warmup:
            return True
    return False


def _recovered(job: Job, before: set[int], worlds: set[int], after: int) -> int | None:
    """The new group (of a size in ``worlds``) once each of its ranks trained ``after`` steps."""
    for group, steps in _by_group(job.steps()).items():
        if group in before or steps[0].world not in worlds:
            continue
        per_rank: dict[int, int] = {}
        for s in steps:
            per_rank[s.rank] = per_rank.get(s.rank, 0) + 1
        if len(per_rank) == steps[0].world and min(per_rank.values()) >= after:
            return group
    return None


def analyse(out: Outcome, job: Job, t_event: float, before: set[int], group: int) -> None:
    steps = job.steps()
    new = [s for s in steps if s.group == group]
    t_first = new[0].t
    first_by_rank: dict[int, float] = {}
    for s in new:
        first_by_rank.setdefault(s.rank, s.t)
    old = [s for s in steps if s.group != group and s.t < t_first]
    out.recovery_first_s = t_first - t_event
    out.recovery_all_s = max(first_by_rank.values()) - t_event
    out.new_group, out.new_world = group, new[0].world
    out.first_new_step = min(s.step for s in new)
    out.last_old_step = max((s.step for s in old), default=0)
    out.redone_steps = max(0, out.last_old_step - out.first_new_step + 1)
    out.stall_s = t_first - max((s.t for s in old), default=t_event)
    out.intermediate_groups = len({s.group for s in steps if s.group not in before} - {group})
    pre = [s for s in steps if s.t <= t_event]
    if pre:
        out.event_at_step = max(s.step for s in pre)
        lead = [s.t for s in pre if s.rank == 0 and s.group == pre[-1].group][-60:]
        gaps = [b - a for a, b in zip(lead, lead[1:], strict=False)]
        out.step_s = statistics.median(gaps) if gaps else None


def run_scenario(system: str, scenario: str, args: argparse.Namespace, endpoint: str | None,
                 work: Path, log_dir: Path | None) -> Outcome:
    tag = secrets.token_hex(4)
    out = Outcome(system, scenario)
    n = args.members
    if system.startswith("peer-elastic"):
        assert endpoint is not None
        job: Job = PeerElasticJob(tag, log_dir, endpoint, system)
    elif system in TORCHFT:
        why = torchft_available()
        if why is not None:
            out.error = f"skipped: {why}"
            return out
        job = TorchftJob(tag, log_dir, system)
    else:
        nnodes = f"{n}:{n + 1}" if scenario == "join" else f"{n - 1}:{n}"
        job = TorchrunJob(tag, log_dir, system, nnodes, work, args.ckpt_every,
                          args.max_restarts, endpoint)
    try:
        for _ in range(n):
            job.start()
        if not wait_until(lambda: _warm(job, n, args.warmup), START_TIMEOUT_S):
            raise RuntimeError(f"job did not reach step {args.warmup} with {n} members")
        time.sleep(0.2 + secrets.randbelow(100) / 1000)  # the event lands anywhere in a step
        before = {s.group for s in job.steps()}
        world = n + 1 if scenario == "join" else n - 1
        worlds = {n - 1, n} if scenario == "hang" else {world}
        target: Member | None = None
        if scenario == "join":
            target = job.start()
            if not wait_until(lambda: target.ready_t is not None, 60):
                raise RuntimeError("the joiner never got ready:\n" + target.tail())
            t_event = target.ready_t  # type: ignore[assignment]
            before = {s.group for s in job.steps() if s.t <= t_event} | before
        else:
            target = job.leader() if scenario == "kill-leader" else job.non_leader()
            g = target.current_group()
            out.target_rank = g.rank if g else None
            t_event = time.time()
            if scenario == "sigterm":
                os.kill(target.pid, signal.SIGTERM)
            elif scenario == "hang":
                # The training process itself: a torchrun agent keeps answering for its
                # node, as it would for a hung worker.
                os.kill(g.pid if g else target.pid, signal.SIGSTOP)
            else:
                job.crash(target)
        out.target_member = target.name
        others = [m for m in job.members if m is not target]

        def done() -> bool:
            if _recovered(job, before, worlds, args.after) is not None:
                return True
            return scenario != "join" and not any(m.alive() for m in others)

        wait_until(done, RECOVERY_TIMEOUT_S[system])
        group = _recovered(job, before, worlds, args.after)
        if group is not None:
            analyse(out, job, t_event, before, group)
            out.ok = True
        elif scenario != "join" and not any(m.alive() for m in others):
            out.job_ended = True
            out.ended_s = max(m.exited_t or time.time() for m in others) - t_event
            pre = [s for s in job.steps() if s.t <= t_event]
            out.event_at_step = max((s.step for s in pre), default=None)
            out.notes.append("every other member exited: the job ended")
        else:
            out.error = f"no recovery within {RECOVERY_TIMEOUT_S[system]:.0f} s"
        if scenario not in ("join", "hang") and target is not None:
            try:
                target.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                out.notes.append("the signalled member had not exited 15 s later")
            out.target_exit = target.proc.poll()
            if out.target_exit is not None and wait_until(lambda: target.exited_t is not None, 5):
                out.target_exit_s = target.exited_t - t_event  # type: ignore[operator]
    except Exception as exc:  # report and go on with the next scenario
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        closed = job.close()
        out.leftovers = closed["leftovers"]
        if out.error and job.members:
            out.notes.append("tails: " + " || ".join(
                f"{m.name}: {m.tail(8)!r}" for m in job.members))
    return out


# --- summary ----------------------------------------------------------------------------------------


def merge(runs: list[Outcome]) -> dict[str, Any]:
    """Median over repetitions of one (system, scenario); every run kept."""
    good = [r for r in runs if r.ok]
    summary: dict[str, Any] = {"runs": [asdict(r) for r in runs], "n": len(runs),
                               "n_ok": len(good)}
    if good:
        for key in ("recovery_all_s", "recovery_first_s", "stall_s", "step_s"):
            vals = [getattr(r, key) for r in good if getattr(r, key) is not None]
            if vals:
                summary[key] = statistics.median(vals)
                summary[key + "_max"] = max(vals)
        summary["redone_steps"] = max(r.redone_steps or 0 for r in good)
    ended = [r for r in runs if r.job_ended]
    if ended and not good:
        summary["job_ended"] = True
        summary["ended_s"] = statistics.median(r.ended_s for r in ended if r.ended_s is not None)
    summary["errors"] = [r.error for r in runs if r.error]
    summary["leftovers"] = sorted({p for r in runs for p in r.leftovers})
    return summary


def cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    if "recovery_all_s" in s:
        return f"{s['recovery_all_s']:.2f} s, {s['redone_steps']} re-done"
    if s.get("job_ended"):
        return f"job ended ({s['ended_s']:.1f} s)"
    return "failed"


def ratio(slow: dict[str, Any] | None, fast: dict[str, Any] | None) -> float | None:
    if not slow or not fast or "recovery_all_s" not in slow or "recovery_all_s" not in fast:
        return None
    return slow["recovery_all_s"] / fast["recovery_all_s"]


def table(results: dict[str, dict[str, dict[str, Any]]], scenarios: list[str],
          systems: list[str]) -> str:
    cols = ["scenario", *systems]
    pe = "peer-elastic" if "peer-elastic" in systems else None
    ratio_cols = [s for s in systems if (s.startswith("torchrun") and s not in TORCHRUN_PE)
                  or s in TORCHFT] if pe else []
    cols += [f"{s.removeprefix('torchrun-')} / pe" for s in ratio_cols]
    rows = []
    for sc in scenarios:
        row = [sc] + [cell(results.get(sy, {}).get(sc)) for sy in systems]
        for sy in ratio_cols:
            r = ratio(results.get(sy, {}).get(sc), results.get(pe, {}).get(sc))  # type: ignore[arg-type]
            tr = results.get(sy, {}).get(sc) or {}
            row.append(f"{r:.1f}x" if r is not None else ("never" if tr.get("job_ended") else "-"))
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
             for r in [cols, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def details(results: dict[str, dict[str, dict[str, Any]]], scenarios: list[str],
            systems: list[str]) -> str:
    """Every measured number per (system, scenario): medians, and the worst run."""
    cols = ["system", "scenario", "runs", "all (s)", "worst (s)", "first (s)", "stall (s)",
            "re-done", "step (ms)"]
    rows = []
    for sy in systems:
        for sc in scenarios:
            s = results.get(sy, {}).get(sc)
            if s is None:
                continue
            if "recovery_all_s" not in s:
                rows.append([sy, sc, f"{s['n_ok']}/{s['n']}", cell(s), "", "", "", "", ""])
                continue
            rows.append([sy, sc, f"{s['n_ok']}/{s['n']}", f"{s['recovery_all_s']:.3f}",
                         f"{s['recovery_all_s_max']:.3f}", f"{s['recovery_first_s']:.3f}",
                         f"{s['stall_s']:.3f}", str(s["redone_steps"]),
                         f"{s['step_s'] * 1000:.1f}" if s.get("step_s") else "-"])
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
             for r in [cols, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def targets(results: dict[str, dict[str, dict[str, Any]]], scenarios: list[str]) -> list[str]:
    """One line per recovery goal: met, missed, or not measured in this run."""
    out = []
    pe = results.get("peer-elastic", {})
    for sc in scenarios:
        s = pe.get(sc)
        if not s or "recovery_all_s" not in s:
            continue
        worst = s["recovery_all_s_max"]
        if sc == "hang":
            ok = worst <= TARGET_HANG_S
            out.append(f"{sc}: within {TARGET_HANG_S:.0f} s (lease TTL + join_timeout + 2 s): "
                       f"{'met' if ok else 'MISSED'} (worst {worst:.2f} s)")
        elif sc in ("join", "sigterm"):
            ok = worst <= TARGET_GRACEFUL_S and s["redone_steps"] == 0
            out.append(f"{sc}: within {TARGET_GRACEFUL_S} s, 0 re-done: "
                       f"{'met' if ok else 'MISSED'} (worst {worst:.2f} s, "
                       f"{s['redone_steps']} re-done)")
        else:
            ok = worst <= TARGET_CRASH_S
            out.append(f"{sc}: within {TARGET_CRASH_S} s: {'met' if ok else 'MISSED'} "
                       f"(worst {worst:.2f} s)")
        if sc == "hang":
            continue  # the ratio targets are the crash targets; a hang has its own bound
        for sy, want in (("torchrun-tuned", TARGET_VS_TUNED),
                         ("torchrun-default", TARGET_VS_DEFAULT)):
            tr = results.get(sy, {}).get(sc)
            if tr is None:
                continue
            r = ratio(tr, s)
            if r is None and tr.get("job_ended"):
                out.append(f"{sc}: >= {want:.0f}x {sy}: met ({sy} never recovers: its job "
                           f"ended)")
            elif r is not None:
                out.append(f"{sc}: >= {want:.0f}x {sy}: {'met' if r >= want else 'MISSED'} "
                           f"({r:.1f}x)")
    return out


def run_plan(systems: list[str], scenarios: list[str], pe_repeat: int, repeat: int,
             interleave: bool) -> list[tuple[str, str, int]]:
    """(system, scenario, repetition) in the order they run: each system's runs in a row,
    or, with ``interleave``, round by round (repetition i of every scenario on every system,
    side by side, before repetition i + 1), so that a machine whose load drifts hits every
    system alike."""
    reps = {sy: pe_repeat if sy.startswith("peer-elastic") else repeat for sy in systems}
    plan = [(sy, sc, i) for sy in systems for sc in scenarios for i in range(reps[sy])]
    if interleave:
        # Within a round, one scenario on every system, then the next scenario.
        plan.sort(key=lambda run: (run[2], scenarios.index(run[1])))
    return plan


def machine() -> dict[str, Any]:
    import torch

    import peer_elastic

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "peer_elastic": peer_elastic.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"systems {','.join(QUICK_SYSTEMS)}, scenarios "
                         f"{','.join(QUICK_SCENARIOS)}, one run each")
    ap.add_argument("--scenarios", default=None,
                    help=f"comma-separated, from {','.join(SCENARIOS)} (default all)")
    ap.add_argument("--systems", default=None,
                    help=f"comma-separated, from {','.join(ALL_SYSTEMS)} (default "
                         f"{','.join(SYSTEMS)})")
    ap.add_argument("--members", type=int, default=3, help="members per job (default 3)")
    ap.add_argument("--warmup", type=int, default=30, help="steps before the event (30)")
    ap.add_argument("--after", type=int, default=20,
                    help="steps every rank of the new group trains before the stop (20)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per torchrun scenario, either rendezvous (1)")
    ap.add_argument("--pe-repeat", type=int, default=None,
                    help="runs per peer-elastic scenario (default 3; quick 1)")
    ap.add_argument("--interleave", action="store_true",
                    help="run round by round (every system and scenario once, then again) "
                         "instead of each system's runs in a row: fairer on a shared machine")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun checkpoint period (10)")
    ap.add_argument("--max-restarts", type=int, default=10, help="torchrun --max-restarts (10)")
    ap.add_argument("--logs", default=None, help="keep every process's output in this dir")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)

    scenarios = list(QUICK_SCENARIOS if args.quick else SCENARIOS)
    systems = list(QUICK_SYSTEMS if args.quick else SYSTEMS)
    if args.scenarios:
        scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS] + [s for s in systems
                                                          if s not in ALL_SYSTEMS]
    if bad:
        ap.error(f"unknown scenario/system: {', '.join(bad)}")
    pe_repeat = args.pe_repeat if args.pe_repeat is not None else (1 if args.quick else 3)

    log_dir = Path(args.logs) if args.logs else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    server = None
    results: dict[str, dict[str, dict[str, Any]]] = {}
    t0 = time.monotonic()
    try:
        endpoint = None
        if any(s.startswith("peer-elastic") or s in TORCHRUN_PE for s in systems):
            from peer_elastic.etcd_server import EtcdServer

            server = EtcdServer().start()
            endpoint = server.endpoint
        plan = run_plan(systems, scenarios, pe_repeat, args.repeat, args.interleave)
        all_runs: dict[tuple[str, str], list[Outcome]] = {}
        for system, scenario, i in plan:
            r = run_scenario(system, scenario, args, endpoint, work, log_dir)
            all_runs.setdefault((system, scenario), []).append(r)
            shown = (f"all {r.recovery_all_s:.2f} s, first {r.recovery_first_s:.2f} s, "
                     f"stall {r.stall_s:.2f} s, {r.redone_steps} re-done"
                     if r.ok else f"ended {r.ended_s:.1f} s" if r.job_ended
                     else f"ERROR {r.error}")
            extra = "".join([
                f" (target {r.target_member} rank {r.target_rank} exit "
                f"{r.target_exit} after {r.target_exit_s or 0:.2f} s)"
                if r.target_rank is not None else "",
                f" LEFTOVERS {r.leftovers}" if r.leftovers else "",
                f" notes: {'; '.join(r.notes)}" if r.notes else ""])
            print(f"[{time.monotonic() - t0:6.1f} s] {system:18} {scenario:12} "
                  f"#{i + 1}: {shown}{extra}", flush=True)
        for system in systems:
            for scenario in scenarios:
                if (system, scenario) in all_runs:
                    results.setdefault(system, {})[scenario] = merge(all_runs[system, scenario])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(table(results, scenarios, systems))
    print()
    print(details(results, scenarios, systems))
    print()
    print("recovery = event -> every rank of the re-formed group completed a step (median of "
          "runs); re-done = steps trained again after the change")
    goals = targets(results, scenarios)
    for line in goals:
        print("target", line)
    if args.out:
        doc = {"machine": machine(), "args": vars(args), "scenarios": scenarios,
               "systems": systems, "results": results, "targets": goals,
               "wall_s": time.monotonic() - t0}
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    leftovers = any(s.get("leftovers") for r in results.values() for s in r.values())
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
