"""deploy/slurm/peer-elastic.sbatch: syntax, the variables it sets, a dry run under fake
``srun``/``scancel`` (the script's own logic, its etcd on the batch host and the per-task
environment are real; Slurm's scheduling is not), and a job on a real single-node Slurm
(tests/helpers/slurm.py) that trains, loses one step to a graceful leave and gains a second
``srun``. The real-Slurm test skips where Slurm is not installed or not root, except under
``CI``, where it fails instead."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer_elastic import settings_table
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import job_prefix
from peer_elastic.etcd_server import find_etcd_binary, free_port
from peer_elastic.process.netaddr import interface_addresses
from peer_elastic.records import MemberRecord, decode
from tests.helpers.ci import running_in_ci
from tests.helpers.multihost import SETTINGS as MULTIHOST_SETTINGS
from tests.helpers.procs import PeerProc
from tests.helpers.slurm import SlurmCluster, wait_for
from tests.helpers.slurm import unavailable_reason as slurm_unavailable
from tests.helpers.worker_lines import GEN_LINE, STEP_LINE

SBATCH = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "peer-elastic.sbatch"

FAKE_SRUN = """#!/bin/bash
# One task: drop srun's options, give the task a node name and a local id, run it.
while [[ "$1" == --* ]]; do shift; done
# The script starts its tasks at once: take the first free slot with an atomic mkdir (a
# read-then-write counter file gave two tasks the same node under load).
n=0; until mkdir "$FAKE_DIR/slot$n" 2>/dev/null; do n=$((n + 1)); done
export SLURMD_NODENAME=node$n SLURM_LOCALID=0
exec "$@"
"""
FAKE_SCANCEL = """#!/bin/bash
echo "$@" >> "$FAKE_DIR/scancel"
"""
# No steps but the script's own: nobody joined with `srun --jobid`.
FAKE_SQUEUE = """#!/bin/bash
echo "$SLURM_JOB_ID.batch"
"""
# The node's address as slurmctld knows it (NodeAddr).
FAKE_SCONTROL = """#!/bin/bash
echo "NodeName=batchnode Arch=x86_64 NodeAddr=$FAKE_NODE_ADDR NodeHostName=batchnode State=MIXED"
"""
TASK = """
import json, os, socket, sys
from peer_elastic.etcd.client import client_from_env
with client_from_env() as c:  # the etcd the script gave us answers
    c.put("/slurm-test/" + os.environ["PEER_ELASTIC_HOST"], b"1")
keys = [k for k in os.environ if k.startswith("PEER_ELASTIC_")]
out = {k: os.environ[k] for k in keys}
out["argv"] = sys.argv[1:]
# Whether etcd also answers on loopback: it must not when bound to the node's address.
port = int(os.environ["PEER_ELASTIC_ETCD"].rsplit(":", 1)[1])
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    out["loopback"] = "open"
except OSError:
    out["loopback"] = "refused"
with open(os.path.join(os.environ["FAKE_DIR"], os.environ["PEER_ELASTIC_HOST"] + ".json"), "w") as f:
    json.dump(out, f)
"""


def test_script_syntax() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_script_sets_only_variables_a_peer_reads() -> None:
    text = SBATCH.read_text()
    set_here = set(re.findall(r"(?:export |\b)(PEER_ELASTIC_[A-Z_]+)=", text))
    assert set_here >= {"PEER_ELASTIC_JOB", "PEER_ELASTIC_ETCD", "PEER_ELASTIC_HOST",
                        "PEER_ELASTIC_LOCAL_RANK"}
    for name in set_here | set(re.findall(r"\$\{?(PEER_ELASTIC_[A-Z_]+)", text)):
        settings_table.by_env(name)  # KeyError: a variable peer-elastic does not read


def node_address() -> str | None:
    """An IPv4 address of this machine other than loopback (the fake NodeAddr), if any."""
    return next((a for _, a in interface_addresses()
                 if ":" not in a and not ipaddress.ip_address(a).is_loopback), None)


def derived_port(job_id: int) -> int:
    """The script's first choice of etcd client port for a job id (20000-29999, even)."""
    return 20000 + 2 * (job_id % 5000)


def dry_run(tmp_path: Path, job_id: int, **extra: str) -> list[dict]:
    """The script under fake srun/scancel/squeue/scontrol, its own etcd real; what each of
    the 3 tasks saw."""
    try:
        etcd_bin = find_etcd_binary()
    except FileNotFoundError:
        pytest.skip("no etcd binary")
    fake = tmp_path / "bin"
    fake.mkdir(parents=True)
    for name, body in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE),
                       ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    task = tmp_path / "task.py"
    task.write_text(TASK)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PEER_ELASTIC_", "SLURM", "ETCD_", "TRAIN_"))}
    env.update(PATH=f"{fake}:{Path(sys.executable).parent}:{env['PATH']}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(job_id), SLURM_NTASKS="3", TMPDIR=str(tmp_path),
               TRAIN_PYTHON=sys.executable, PEER_ELASTIC_ETCD_BINARY=etcd_bin,
               PYTHONPATH=os.pathsep.join(sys.path), FAKE_NODE_ADDR="127.0.0.1")
    env.update(extra)
    proc = subprocess.run(["bash", str(SBATCH), str(task), "--epochs", "2"], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(tmp_path.glob("node*.json"))
    assert [p.stem for p in seen] == ["node0", "node1", "node2"]
    docs = [json.loads(p.read_text()) for p in seen]
    for p, doc in zip(seen, docs, strict=True):
        assert doc["PEER_ELASTIC_JOB"] == f"slurm-{job_id}"
        assert doc["PEER_ELASTIC_HOST"] == p.stem
        assert doc["PEER_ELASTIC_LOCAL_RANK"] == "0"
        assert doc["argv"] == ["--epochs", "2"]
    assert shutil.which("srun", path=str(fake))
    return docs


@pytest.mark.timeout(120)
def free_port_pair() -> int:
    """A loopback port P with P + 1 free as well (the script's etcd listens on both), both
    probed while held together."""
    for _ in range(100):
        port = free_port()
        probes = [socket.socket(), socket.socket()]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise AssertionError("no free loopback port pair")


def test_dry_run_starts_etcd_and_one_peer_per_task(tmp_path: Path) -> None:
    # Between the probe and etcd's bind another process may take a port (the suite runs
    # beside other work); etcd then says so and a new pair is tried, as EtcdServer does.
    for attempt in range(3):
        port = free_port_pair()
        try:
            docs = dry_run(tmp_path / f"try{attempt}", 4242, ETCD_PORT=str(port),
                           ETCD_ADDR="127.0.0.1")
            break
        except AssertionError as exc:
            if "address already in use" not in str(exc) or attempt == 2:
                raise
    assert {d["PEER_ELASTIC_ETCD"] for d in docs} == {f"127.0.0.1:{port}"}


@pytest.mark.timeout(120)
def test_dry_run_etcd_binds_the_node_address_on_a_free_port_from_the_job_id(
        tmp_path: Path) -> None:
    """No 0.0.0.0: the plaintext etcd listens on the node's cluster address (NodeAddr) only,
    on the job id's port, or the next free one when that is taken."""
    addr = node_address()
    if addr is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    job_id = 4242
    taken = socket.socket()
    try:
        taken.bind((addr, derived_port(job_id)))  # held: the script must move on
        taken.listen()
    except OSError:
        pass  # held by someone else already: the same for the script
    try:
        docs = dry_run(tmp_path, job_id, FAKE_NODE_ADDR=addr)
    finally:
        taken.close()
    (endpoint,) = {d["PEER_ELASTIC_ETCD"] for d in docs}
    host, port = endpoint.rsplit(":", 1)
    assert host == addr
    assert int(port) != derived_port(job_id)
    assert 20000 <= int(port) < 30000 and (int(port) - derived_port(job_id)) % 2 == 0
    assert {d["loopback"] for d in docs} == {"refused"}, "etcd listens beyond the node address"


def test_script_binds_no_wildcard_address_and_says_it_is_plaintext() -> None:
    text = SBATCH.read_text()
    assert "0.0.0.0" not in text and "[::]" not in text
    assert "PLAINTEXT" in text and "trusted cluster network" in text


def test_script_has_gpu_lines_and_maps_the_steps_gpu_to_the_local_rank() -> None:
    text = SBATCH.read_text()
    # Commented out (sbatch reads '#SBATCH' only), ready to enable.
    assert re.search(r"^##SBATCH --gpus-per-node=\d+$", text, re.M)
    assert "--gpus-per-task=" in text
    assert "SLURM_STEP_GPUS" in text and "CUDA_VISIBLE_DEVICES" in text and "nccl" in text


@pytest.mark.parametrize("step_gpus, localid, rank", [("3", "0", "3"), ("2,3", "0", "2"),
                                                      ("", "1", "1")])
def test_local_rank_is_the_steps_first_gpu_else_its_local_id(
        step_gpus: str, localid: str, rank: str, tmp_path: Path) -> None:
    """The command each step runs, taken from the script and run here."""
    m = re.search(r"bash -c '(.*?)' peer", SBATCH.read_text(), re.S)
    assert m, "the step command"
    env = dict(os.environ, SLURMD_NODENAME="n1", SLURM_LOCALID=localid)
    env.pop("SLURM_STEP_GPUS", None)
    if step_gpus:
        env["SLURM_STEP_GPUS"] = step_gpus
    proc = subprocess.run(["bash", "-c", m.group(1), "peer", "sh", "-c",
                           'echo "$PEER_ELASTIC_HOST $PEER_ELASTIC_LOCAL_RANK"'],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["n1", rank]


# --- on a real Slurm ----------------------------------------------------------------------------
# A private single-node Slurm (tests/helpers/slurm.py: munged, slurmctld, slurmd from Debian's
# packages, run by the test). The sbatch script starts a job of 3 tasks, one step each, running
# the elastic test worker against the test's etcd; one step gets `scancel --signal=TERM
# <job>.<step>` and leaves gracefully; a second `srun --jobid` joins; the exactly-once oracle
# checks the result.

# The multi-host test's settings (short lease and join timeouts, the same worker job size).
REAL_SETTINGS = {**MULTIHOST_SETTINGS, "PYTHONUNBUFFERED": "1"}
WORKER = "tests/helpers/elastic_worker.py"


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    reason = slurm_unavailable()
    if reason:
        if running_in_ci():
            pytest.fail(f"CI is set, so the real-Slurm test must run, but: {reason} "
                        "(.ci/run installs the packages when run as root)")
        pytest.skip(f"real-Slurm test: {reason}")
    cluster = SlurmCluster(cpus=8)
    try:
        cluster.start(timeout=60)
        yield cluster
    finally:
        cluster.close()


class Output:
    """What one peer printed: a step's output file (``SLURM_STDOUTMODE=...%s...``), or the
    stdout of a ``srun`` the test runs (:class:`PeerProc`)."""

    def __init__(self, name: str, path: Path | None = None, proc: PeerProc | None = None) -> None:
        self.name, self.path, self.proc = name, path, proc

    def lines(self) -> list[str]:
        if self.proc is not None:
            with self.proc.cond:
                return list(self.proc.lines)
        try:
            text = self.path.read_text(errors="replace")  # type: ignore[union-attr]
        except FileNotFoundError:
            return []
        lines = text.split("\n")
        return lines[:-1]  # whole lines only: the last one may be half written

    def gens(self, after: int = 0) -> list[tuple[int, int, int, int]]:
        """(line index, generation, rank, size) of every GEN line at index >= ``after``."""
        return [(i, *map(int, m.groups())) for i, line in enumerate(self.lines())
                if i >= after and (m := GEN_LINE.fullmatch(line))]

    def steps(self, generation: int) -> int:
        return sum(1 for line in self.lines()
                   if (m := STEP_LINE.fullmatch(line)) and int(m.group(3)) == generation)

    def results(self) -> list[dict]:
        return [json.loads(line.split(" ", 1)[1]) for line in self.lines()
                if line.startswith("RESULT ")]

    def tail(self, n: int = 40) -> str:
        return f"--- {self.name}\n" + "\n".join(self.lines()[-n:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_slurm_job_trains_one_step_leaves_a_second_srun_joins(
    slurm: SlurmCluster, etcd: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    end_file = tmp_path / "end"
    env = {k: v for k, v in slurm.env.items() if not k.startswith("PEER_ELASTIC_")}
    env.update({k: str(v) for k, v in REAL_SETTINGS.items()})
    env.update(PEER_ELASTIC_ETCD=etcd, TRAIN_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(sys.path), WORKER_END_FILE=str(end_file))
    # Each step's output in a file of its own (srun reads SLURM_STDOUTMODE like --output).
    batch_env = dict(env, SLURM_STDOUTMODE=str(tmp_path / "step-%j.%s.out"))
    root = SBATCH.parent.parent.parent
    sub = slurm.run("sbatch", "--parsable", "--nodes=1", "--ntasks=3", "--ntasks-per-node=3",
                    "--cpus-per-task=1", "--time=10", f"--output={tmp_path}/batch-%j.out",
                    f"--chdir={root}", str(SBATCH), WORKER, env=batch_env)
    job = sub.stdout.strip().split(";")[0]
    outs = {s: Output(f"step {job}.{s}", path=tmp_path / f"step-{job}.{s}.out") for s in range(3)}
    joiner: PeerProc | None = None

    def details() -> str:
        parts = [o.tail() for o in outs.values()]
        batch = tmp_path / f"batch-{job}.out"
        if batch.exists():
            parts.append(f"--- batch\n{batch.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts) + "\n" + slurm.logs(20)

    def wait_gen(o: Output, size: int, after: int = 0, timeout: float = 60) -> int:
        return wait_for(f"{o.name}: a world of {size} after line {after}",
                        lambda: next((g for _, g, _, s in o.gens(after) if s == size), None),
                        timeout, details=details)

    def reformed(size: int, *os_: Output, marks: dict[str, int], timeout: float = 60) -> int:
        g = max(wait_gen(o, size, marks.get(o.name, 0), timeout) for o in os_)
        wait_for(f"{os_[0].name}: 2 steps in generation {g}",
                 lambda: True if os_[0].steps(g) >= 2 else None, timeout, details=details)
        return g

    try:
        # 1. Three tasks, one step each (job.0, .1, .2), form a world of 3 and train.
        wait_for("3 running steps", lambda: True if slurm.steps(job) == [
            f"{job}.{s}" for s in range(3)] else None, 60, details=details)
        g = reformed(3, *outs.values(), marks={}, timeout=90)
        t_formed = time.monotonic()
        with EtcdClient(etcd) as client:
            kvs, _ = client.get_prefix(job_prefix(f"slurm-{job}"))  # the script's job name
        hosts = [decode(MemberRecord, kv.value, kv.key).host for kv in kvs
                 if "/members/" in kv.key]
        assert hosts == [slurm.node] * 3, hosts  # PEER_ELASTIC_HOST: the Slurm node

        # 2. `scancel --signal=TERM <job>.<step>` on one step (not rank 0): that peer leaves
        # gracefully, the other two re-form as 2 and go on.
        leaving = next(s for s, o in outs.items() if [r for _, gg, r, _ in o.gens() if gg == g]
                       != [0])
        stay = [o for s, o in outs.items() if s != leaving]
        marks = {o.name: len(o.lines()) for o in stay}
        slurm.run("scancel", "--signal=TERM", f"{job}.{leaving}")
        reformed(2, *stay, marks=marks)
        wait_for(f"step {job}.{leaving} ended", lambda: True if f"{job}.{leaving}" not in
                 slurm.steps(job) else None, 60, details=details)
        left = "\n".join(outs[leaving].lines())
        assert "leaving job" in left and "Traceback" not in left, details()

        # 3. A second srun in the same allocation joins: a world of 3 again.
        join_env = dict(env, PEER_ELASTIC_JOB=f"slurm-{job}")
        marks = {o.name: len(o.lines()) for o in stay}
        joiner = PeerProc(["srun", f"--jobid={job}", "--ntasks=1", "--exact",
                           "--kill-on-bad-exit=0", sys.executable, WORKER], join_env, "srun-join")
        joined = Output(f"srun --jobid={job}", proc=joiner)
        outs[3] = joined
        reformed(3, joined, *stay, marks=marks, timeout=90)
        assert slurm.steps(job) == sorted(f"{job}.{s}" for s in range(4) if s != leaving)

        # 4. End the job: every step exits 0 (the left one included: the batch script exits
        # with the first non-zero step status), every sample trained once, ranks identical.
        end_file.touch()
        assert joiner.wait(120) == 0, details()

        def done() -> str | None:
            st = slurm.job(job)["JobState"]
            return None if st in ("PENDING", "RUNNING", "COMPLETING") else st

        state = wait_for("the job done", done, 120, details=details)
        info = slurm.job(job)
        assert (state, info["ExitCode"]) == ("COMPLETED", "0:0"), details()
        found = [r for o in outs.values() for r in o.results()]
        assert len(found) == 1, (found, details())
        res = found[0]
        assert res["exact"] and res["identical"] and res["world"] == 3, res
        print(f"real Slurm: world of 3 {t_formed - t0:.1f} s after sbatch, "
              f"whole test {time.monotonic() - t0:.1f} s")
    finally:
        if joiner is not None:
            joiner.kill()
