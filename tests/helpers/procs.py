"""Peers as subprocesses, with their output collected and every process bounded."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers import prefork
from tests.helpers.at_exit import PREFIX as THREADS_AT_EXIT
from tests.helpers.place import Place
from tests.helpers.worker_lines import results

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.helpers.elastic_worker"
#: Test workers that answer SIGUSR1 with every thread's stack (faulthandler).
STACKS_ON_SIGUSR1 = frozenset({WORKER, "tests.helpers.vote_worker"})


class PeerProc:
    """One subprocess whose stdout lines are collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str], name: str,
                 stacks_signal: int | None = None, forked: bool = False,
                 pool: prefork.Pool | None = None, place: Place | None = None) -> None:
        """``forked``: a ``python -m`` peer may be started as a fork of a process that has
        imported torch already (tests/helpers/prefork.py), which spares it that import;
        by a server of ``pool``, or else of the pool this pytest process shares.
        ``place``: it runs there (a network namespace, another host's namespaces)."""
        self.name = name
        # A signal the process answers by writing every thread's stack (faulthandler), sent
        # when it does not exit in time, so the failure says where it hangs.
        self.stacks_signal = stacks_signal
        self.lines: list[str] = []
        self.arrived: list[float] = []  # time.monotonic() when each line was read
        self.cond = threading.Condition()
        proc = None
        if forked:
            proc = (pool.start(args, env, ROOT, place) if pool is not None
                    else prefork.start(args, env, ROOT, place))
        self.proc: subprocess.Popen[str] | prefork.ForkedProcess = proc or subprocess.Popen(
            args if place is None else place.exec_args(args), cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.arrived.append(time.monotonic())
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ended(self) -> bool:
        """Exited, and every line it wrote is in ``lines`` (the reader reached the end)."""
        return self.proc.poll() is not None and not self._reader.is_alive()

    def wait_line(self, prefix: str, timeout: float = 60, after: int = 0) -> str:
        """First line starting with ``prefix`` at index >= ``after`` (bounded wait)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines[after:]:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.ended():
                    raise AssertionError(
                        f"{self.name}: no line starting {prefix!r}; output:\n" + self.output())
                self.cond.wait(min(left, 0.5))

    def output(self) -> str:
        with self.cond:
            return "\n".join(self.lines[-80:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            before = self.output()
            raise AssertionError(f"{self.name} did not exit in {timeout} s:\n{before}"
                                 f"{self.dump_stacks()}{native_stacks(self.proc.pid)}") from None

    def dump_stacks(self, wait_s: float = 5.0, quiet_s: float = 0.5) -> str:
        """Every thread's stack, as the process writes it on ``stacks_signal`` ("" without
        one): the lines that arrived after asking, unabridged, until none came for
        ``quiet_s`` (faulthandler writes them at once) or ``wait_s`` passed."""
        if self.stacks_signal is None or self.proc.poll() is not None:
            return ""
        with self.cond:
            start = len(self.lines)
        try:
            os.kill(self.proc.pid, self.stacks_signal)
        except ProcessLookupError:  # it exited meanwhile
            return ""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while (left := deadline - time.monotonic()) > 0:
                seen = len(self.lines)
                self.cond.wait(min(quiet_s, left))  # woken by each line the reader adds
                if start < seen == len(self.lines):
                    break  # lines came, then none for a while
            return "\n--- stacks:\n" + "\n".join(self.lines[start:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever inherited it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def native_stacks(pid: int, timeout: float = 90.0) -> str:
    """Every thread's native stack (gdb's ``thread apply all bt``), "" without gdb.

    Why besides faulthandler's: a process hung in its interpreter's exit (after its last
    Python frame) or inside a C++ destructor shows nothing useful in Python stacks; CI saw
    peers print their result and then never exit."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:  # field 3 of /proc/PID/stat, after the parenthesised name
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""  # it exited meanwhile
    if state in ("T", "t", "Z"):  # stopped (SIGSTOP, a test's pause) or a zombie: no attach
        return f"\n--- native stacks of {pid}: not taken, its state is {state}"
    try:
        out = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
             "-ex", "thread apply all bt"],
            capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"\n--- native stacks of {pid}: gdb failed: {exc}"
    # Only the threads' frames: gdb's loading chatter is hundreds of lines.
    kept = [line for line in out.splitlines() if line.startswith(("Thread ", "#"))]
    return f"\n--- native stacks of {pid}:\n" + "\n".join(kept)


def assert_no_thread_of_ours_left(p: PeerProc) -> None:
    """``p`` (a test worker, which reports at exit: tests/helpers/at_exit.py) exited with
    no thread of peer-elastic, nor a watch thread of its etcd client, still running: one
    running into the interpreter's exit can abort or hang it (peer_elastic.process.threads).

    gRPC's own helper threads may show in ``others`` for a moment, woken but not yet
    scheduled (a stream's request sender, handed the end of its requests): pure Python
    there, and beyond what the client can wait for."""
    with p.cond:
        left = [line for line in p.lines if line.startswith(THREADS_AT_EXIT)
                and ("ours=[]" not in line or "etcd3_watch_" in line)]
    assert not left, f"{p.name}: threads of peer-elastic outlived join(): {left}\n{p.output()}"


def others_output(peers: list[PeerProc], but: PeerProc, tail: int = 4000) -> str:
    """The end of every other peer's output, for a failure message."""
    return "\n".join(f"--- {p.name} (exit {p.proc.poll()})\n{p.output()[-tail:]}"
                     for p in peers if p is not but)


def assert_exactly_once(peers: list[PeerProc], timeout: float = 240) -> dict:
    """Every peer exits 0 (each within ``timeout``), and the job's one RESULT says every
    sample was trained exactly once on bit-identical ranks. Returns that RESULT."""
    for p in peers:
        try:
            code = p.wait(timeout)
        except AssertionError as exc:  # the cause is often in another peer's output
            raise AssertionError(f"{exc}\n{others_output(peers, p)}") from None
        assert code == 0, f"{p.name} exited {code}:\n{p.output()}\n{others_output(peers, p)}"
        assert_no_thread_of_ours_left(p)
    found = results(peers)
    assert len(found) == 1 and found[0]["exact"] and found[0]["identical"], found
    return found[0]


class Cluster:
    """Elastic-worker peers of one job; all killed in ``close``."""

    def __init__(self, endpoint: str, job: str, **settings: object) -> None:
        self.env = dict(os.environ)
        self.env.update({"PEER_ELASTIC_ETCD": endpoint, "PEER_ELASTIC_JOB": job,
                         "PYTHONUNBUFFERED": "1"})
        for k, v in settings.items():
            self.env[k] = str(v)
        self.peers: list[PeerProc] = []

    def start(self, n: int = 1, module: str = WORKER, place: Place | None = None,
              where: str = "", **extra_env: object) -> list[PeerProc]:
        """Start ``n`` peers, in ``place`` where one is given (another host's namespaces,
        :attr:`tests.helpers.hosts.Host.place`), named ``where``."""
        out = []
        for _ in range(n):
            env = dict(self.env, **{k: str(v) for k, v in extra_env.items()})
            argv = [sys.executable, "-m", module]
            p = PeerProc(argv, env, f"peer{len(self.peers)}{'@' + where if where else ''}",
                         stacks_signal=signal.SIGUSR1 if module in STACKS_ON_SIGUSR1 else None,
                         forked=True, place=place)
            self.peers.append(p)
            out.append(p)
        return out

    def close(self) -> None:
        for p in self.peers:
            p.kill()
        self._keep_logs()

    def _keep_logs(self) -> None:
        """With ``PEER_ELASTIC_TEST_LOG_DIR`` set, every peer's whole output is written there
        (``<job>.<peer>.log``): a failure shows only the peer that failed, and often the
        cause is in another one's log (run with ``PEER_ELASTIC_LOG_LEVEL=INFO`` too)."""
        where = os.environ.get("PEER_ELASTIC_TEST_LOG_DIR")
        if not where:
            return
        Path(where).mkdir(parents=True, exist_ok=True)
        job = self.env["PEER_ELASTIC_JOB"]
        for p in self.peers:
            with p.cond:
                text = "\n".join(p.lines)
            (Path(where) / f"{job}.{p.name}.log").write_text(text + "\n")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               peers: list[PeerProc]) -> None:
    """Poll a condition on files or output (bounded; for files, which wake nothing); fail
    with the peers' output when ``timeout`` passes or every peer has exited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = bool(peers) and all(p.proc.poll() is not None for p in peers)
        if time.monotonic() > deadline or ended:
            raise AssertionError(f"no {what}:\n" + "\n".join(p.output() for p in peers))
        time.sleep(0.1)
