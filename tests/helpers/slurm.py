"""A private single-node Slurm for tests: its own munged, slurmctld and slurmd.

Everything lives in one temporary directory: the munge key and socket, ``slurm.conf``, the
state, spool and log directories, the pid files. The daemons are children of the test,
listen on ports picked free on this host, and the clients find them through ``SLURM_CONF``
in :attr:`SlurmCluster.env`, so nothing system-wide is read or changed (``/etc/slurm`` and
``/etc/munge`` stay as the packages left them, and a site's Slurm on this host is not
touched).

What makes it run in a container without systemd or a writable cgroup tree: process
tracking by ``proctrack/linuxproc`` (the process tree, no cgroups), ``task/none`` (no
binding or cgroup confinement), no accounting, no job container; and ``SlurmdParameters=
config_overrides``, so that the node has the CPUs the configuration says (4+ tasks on a
2-core machine) instead of slurmd refusing a configuration bigger than the hardware.

Needs root (slurmd starts job steps as the submitting user, and munged runs as that user
here) and Debian's ``slurmctld slurmd slurm-client munge`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from peer_elastic.etcd_server import free_ports

__all__ = ["SlurmCluster", "SlurmUnavailable", "unavailable_reason"]

T = TypeVar("T")

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"
# Environment a Slurm client reads that must not leak in from a job the tests run inside of.
CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")


class SlurmUnavailable(RuntimeError):
    """The daemons did not come up; the message has their logs."""


def _which(name: str) -> str | None:
    # munged, slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


def unavailable_reason() -> str | None:
    """Why a private Slurm cannot run here, or None if it can."""
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): {INSTALL}"
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd starts job steps as the submitting user)"
    return None


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             interval: float = 0.2, details: Callable[[], str] = lambda: "") -> T:
    """Poll ``probe`` until it returns something other than None; AssertionError at the
    deadline (with ``details()``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{details()}")
        time.sleep(interval)


class SlurmCluster:
    """One Slurm node (this host) and one partition, run by the test; see the module doc.

    ``start()`` brings it up and waits for the node to be idle; ``close()`` cancels every
    job, stops the daemons and kills whatever of its jobs still runs. A context manager.
    """

    def __init__(self, cpus: int = 8, kill_wait_s: int = 5) -> None:
        self.cpus = cpus
        self.kill_wait_s = kill_wait_s
        self.node = socket.gethostname().split(".")[0]
        self.partition = "pe"
        self.dir = Path(tempfile.mkdtemp(prefix="pe-slurm-"))
        # munged wants every directory above its socket searchable by all.
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_ENV_PREFIXES)}
        self.env["SLURM_CONF"] = str(self.conf)
        # A job id far from 1: the sbatch script names the job slurm-<id>, and an etcd that
        # outlives this cluster must not see the same name twice.
        self.first_job_id = 100_000 + secrets.randbelow(10_000_000)

    # --- set-up ---------------------------------------------------------------------------

    def _write_munge_key(self) -> Path:
        keydir = self.dir / "munge"
        keydir.mkdir(mode=0o700)
        key = keydir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        return key

    def _write_conf(self, ctld_port: int, slurmd_port: int) -> None:
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        (d / "plugstack.conf").write_text("")  # not the system's /etc/slurm/plugstack.conf
        self.conf.write_text(f"""\
ClusterName=pe{secrets.token_hex(3)}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
PlugStackConfig={d}/plugstack.conf
MailProg=/bin/true
# No cgroups: a container has no writable cgroup tree of its own.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobContainerType=job_container/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node has the CPUs written here, whatever the hardware has.
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={self.first_job_id}
KillWait={self.kill_wait_s}
NodeName={self.node} NodeHostname={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1024 State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.out", "wb")  # the child keeps its own copy
        try:
            self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=out,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)
        finally:
            out.close()

    def _alive_or_fail(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with {p.returncode}\n{self.logs()}")

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; return once ``sinfo`` shows the node idle."""
        key = self._write_munge_key()
        ctld_port, slurmd_port = free_ports(2)
        self._write_conf(ctld_port, slurmd_port)
        munge = self.dir / "munge"
        self._spawn("munged", [_which("munged") or "munged", "--foreground",
                               f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={munge}/munged.pid",
                               f"--log-file={self.dir}/log/munged.log",
                               f"--seed-file={munge}/munged.seed"])
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        def munge_ready() -> bool | None:
            self._alive_or_fail()
            return True if self.munge_socket.exists() else None

        wait_for("munged's socket", munge_ready, left(), details=self.logs)
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd") or "slurmd", "-D", "-N", self.node,
                               "-f", str(self.conf)])

        def idle() -> bool | None:
            self._alive_or_fail()
            r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
            return True if r.returncode == 0 and r.stdout.split() == [self.node, "idle"] else None

        wait_for("the Slurm node idle in sinfo", idle, left(), details=self.logs)
        return self

    # --- use ------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        r = subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def steps(self, job_id: str) -> list[str]:
        """Ids (``<job>.<step>``) of the job's running steps, the batch step left out."""
        r = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i", check=False)
        return sorted(s for s in r.stdout.split() if not s.endswith((".batch", ".extern")))

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def logs(self, lines: int = 40) -> str:
        """The tails of the daemons' logs."""
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            try:
                text = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # --- tear-down ------------------------------------------------------------------------

    def _cancel_all(self, timeout: float) -> None:
        r = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
        jobs = r.stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False, timeout=10)
        try:
            wait_for("jobs gone", lambda: True if not self.run(
                "squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split() else None,
                timeout)
        except AssertionError:
            pass  # the daemons stop anyway; leftovers are killed below

    def _leftovers(self) -> list[int]:
        """Processes started for this cluster (slurmstepd, job steps): SLURM_CONF is ours."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill leftovers, delete the directory."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                self._cancel_all(timeout=self.kill_wait_s + 15)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for pid in self._leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
