"""torchrun --rdzv-backend=peer-elastic on a real etcd: agents, a lost first agent, the job ends well.

Needs the package installed (``pip install -e .``): torchrun finds the backend through the
``torchrun.handlers`` entry point, as a user's torchrun does.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.torchrun import BACKEND, run_prefix

WORKER = Path(__file__).resolve().parent / "helpers" / "torchrun_rdzv_worker.py"

pytestmark = pytest.mark.slow


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="torchrun.handlers")
    return any(ep.name == BACKEND for ep in eps)


requires_entry_point = pytest.mark.skipif(
    not _entry_point_installed(),
    reason="the torchrun.handlers entry point is not installed (pip install -e .)")


def test_entry_point_loads_a_handler_factory() -> None:
    if not _entry_point_installed():
        pytest.skip("the torchrun.handlers entry point is not installed (pip install -e .)")
    from torch.distributed.elastic.rendezvous import registry

    registry._register_out_of_tree_handlers()
    assert registry.handler_registry._registry.get(BACKEND) is not None


def _agent(etcd: str, job: str, out: Path, steps: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, RDZV_TEST_DIR=str(out), RDZV_TEST_STEPS=str(steps),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PEER_ELASTIC_ETCD", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--rdzv-backend={BACKEND}",
           f"--rdzv-endpoint={etcd}", f"--rdzv-id={job}", "--nnodes=2:3", "--nproc-per-node=1",
           "--max-restarts=5", "--monitor-interval=0.5", "--local-addr=127.0.0.1",
           "--rdzv-conf=lease_ttl=3,last_call_timeout=2", str(WORKER)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(predicate, timeout: float, what: str, procs: list[subprocess.Popen], logs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs)
            raise AssertionError(f"timed out: {what}\n{tails}")
        time.sleep(0.2)


def _agents_registered(etcd: str, job: str) -> int:
    with EtcdClient(etcd) as client:
        kvs, _ = client.get_prefix(run_prefix(job) + "agents/")
    return len(kvs)


@requires_entry_point
@pytest.mark.timeout(240)
def test_losing_the_first_agent_does_not_end_the_job(etcd: str, unique_job: str,
                                                     tmp_path: Path) -> None:
    """Three agents; SIGKILL the oldest (group rank 0) with its worker mid-run; the two others
    form a new round without it, resume from the step file and finish with exit status 0."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_agent(etcd, unique_job, out, 80, logs[0]))
        # The first agent registers before the others start: it is the oldest, so rank 0.
        _wait(lambda: _agents_registered(etcd, unique_job) >= 1, 60, "first agent registers",
              procs, logs)
        for i in (1, 2):
            procs.append(_agent(etcd, unique_job, out, 80, logs[i]))
        step = out / "step"
        _wait(lambda: step.exists() and int(step.read_text() or 0) >= 10, 120,
              "three agents train 10 steps", procs, logs)
        rounds = (out / "rounds").read_text().split()
        assert "3" in rounds[2::3], rounds  # a round of three formed
        first = procs[0]
        agent_pid, worker_pid = map(int, (out / "rank0").read_text().split())
        assert agent_pid == first.pid, "the oldest agent is rank 0"
        # The agent and its worker (torchrun starts workers in a session of their own).
        os.killpg(first.pid, signal.SIGKILL)
        os.killpg(worker_pid, signal.SIGKILL)
        first.wait(10)
        _wait(lambda: all(p.poll() is not None for p in procs[1:]), 150,
              "the two other agents finish", procs, logs)
        codes = [p.returncode for p in procs[1:]]
        tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs)
        assert codes == [0, 0], tails
        assert (out / "done").read_text() == "2", tails
        assert int(step.read_text()) == 80
        # The survivors' last round had two members.
        last = (out / "rounds").read_text().splitlines()[-2:]
        assert all(line.split()[2] == "2" for line in last), last
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


# --- in-process: the handler and the store, no torchrun -------------------------------------


def _params(etcd: str, job: str, min_nodes: int, max_nodes: int, **conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(BACKEND, etcd, job, min_nodes, max_nodes,
                                local_addr="127.0.0.1", **conf)


def test_store_semantics(etcd: str, unique_job: str) -> None:
    import datetime

    from torch.distributed import DistStoreError

    from peer_elastic.torchrun import EtcdV3Store

    with EtcdClient(etcd) as client:
        store = EtcdV3Store(client, run_prefix(unique_job) + "store/1/", lambda: None, 5.0)
        store.set("a", "x")
        assert store.get("a") == b"x"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
        assert store.compare_set("c", "", "v1") == b"v1"
        assert store.compare_set("c", "wrong", "v2") == b"v1"
        assert store.compare_set("c", "v1", "v2") == b"v2"
        assert store.check(["a", "n"]) and not store.check(["a", "missing"])
        assert store.multi_get(["a", "c"]) == [b"x", b"v2"]
        t0 = time.monotonic()
        with pytest.raises(DistStoreError):
            store.wait(["missing"], datetime.timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 3
        assert store.num_keys() == 3 and store.delete_key("a") and store.num_keys() == 2


def test_rounds_rank_agents_by_age_and_admit_newcomers(etcd: str, unique_job: str) -> None:
    import threading

    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    conf = {"last_call_timeout": 1.0, "lease_ttl": 3}
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 3, **conf))
                for _ in range(3)]
    try:
        infos: dict[int, object] = {}

        def rdzv(i: int) -> None:
            infos[i] = handlers[i].next_rendezvous()

        first = threading.Thread(target=rdzv, args=(0,))
        first.start()
        time.sleep(0.5)  # handler 0 registers first: the oldest
        second = threading.Thread(target=rdzv, args=(1,))
        second.start()
        first.join(30)
        second.join(30)
        assert (infos[0].rank, infos[0].world_size) == (0, 2)
        assert (infos[1].rank, infos[1].world_size) == (1, 2)
        assert infos[0].bootstrap_store_info.master_addr == "127.0.0.1"
        assert infos[1].bootstrap_store_info == infos[0].bootstrap_store_info
        # A newcomer waits; the running agents see it and re-rendezvous to admit it.
        third = threading.Thread(target=rdzv, args=(2,))
        third.start()
        deadline = time.monotonic() + 20
        while handlers[0].num_nodes_waiting() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        threads = [threading.Thread(target=rdzv, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in [*threads, third]:
            t.join(30)
        assert sorted((infos[i].rank, infos[i].world_size) for i in range(3)) == \
            [(0, 3), (1, 3), (2, 3)]
        assert infos[0].rank == 0
        assert handlers[0].num_nodes_waiting() == 0
        # Closing ends every later rendezvous.
        handlers[2].set_closed()
        assert handlers[1].is_closed()
        from torch.distributed.elastic.rendezvous import RendezvousClosedError

        with pytest.raises(RendezvousClosedError):
            handlers[1].next_rendezvous()
    finally:
        for h in handlers:
            h.shutdown()
