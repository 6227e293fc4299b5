"""torchrun --rdzv-backend=peer-elastic on a real etcd: agents, a lost first agent, a graceful
leave (SIGTERM), a joiner, standbys beyond ``--nnodes`` MAX, the job ends well; and, in
process, the store, rounds and the address published as MASTER_ADDR.

Needs the package installed (``pip install -e .``): torchrun finds the backend through the
``torchrun.handlers`` entry point, as a user's torchrun does. The real-process tests wait on
what the agents and workers write (the step file, the rounds file, etcd keys), never on fixed
sleeps; each takes 10-40 s on a loaded 2-core machine.
"""

from __future__ import annotations

import importlib.metadata
import json
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


def _agent(etcd: str, job: str, out: Path, steps: int, log: Path, *, nnodes: str = "2:3",
           conf: str = "lease_ttl=3,last_call_timeout=2", finish_world: int = 0,
           local_addr: bool = True) -> subprocess.Popen:
    env = dict(os.environ, RDZV_TEST_DIR=str(out), RDZV_TEST_STEPS=str(steps),
               RDZV_TEST_FINISH_WORLD=str(finish_world), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    env.pop("PEER_ELASTIC_ETCD", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--rdzv-backend={BACKEND}",
           f"--rdzv-endpoint={etcd}", f"--rdzv-id={job}", f"--nnodes={nnodes}",
           "--nproc-per-node=1", "--max-restarts=5", "--monitor-interval=0.5",
           *(["--local-addr=127.0.0.1"] if local_addr else []), f"--rdzv-conf={conf}",
           str(WORKER)]
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
    return len(_keys(etcd, job, "agents/"))


def _keys(etcd: str, job: str, under: str) -> dict[str, bytes]:
    """The run's keys under ``under`` (``agents/``, ``waiting/``), by name, with their values."""
    prefix = run_prefix(job) + under
    with EtcdClient(etcd) as client:
        kvs, _ = client.get_prefix(prefix)
    return {kv.key[len(prefix):]: kv.value for kv in kvs}


def _round(etcd: str, job: str) -> dict:
    with EtcdClient(etcd) as client:
        kv = client.get(run_prefix(job) + "round")
    return json.loads(kv.value) if kv is not None else {"round": 0, "members": []}


def _agent_pids(etcd: str, job: str, under: str) -> set[int]:
    """Agent pids of the ``agents/`` keys (or of those agents' ``waiting/`` keys)."""
    agents = {name: json.loads(v)["pid"] for name, v in _keys(etcd, job, "agents/").items()}
    if under == "agents/":
        return set(agents.values())
    return {agents[name] for name in _keys(etcd, job, under) if name in agents}


def _rounds(out: Path) -> list[tuple[int, int, int]]:
    """(group rank, agent pid, world size) per worker start, in order."""
    path = out / "rounds"
    text = path.read_text() if path.exists() else ""
    return [tuple(map(int, line.split())) for line in text.splitlines()]  # type: ignore[misc]


def _step(out: Path) -> int:
    path = out / "step"
    return int(path.read_text() or 0) if path.exists() else 0


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@requires_entry_point
@pytest.mark.timeout(360)
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
        agent_pid, worker_pid = map(int, (out / "rank0").read_text().split()[:2])
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


@requires_entry_point
@pytest.mark.timeout(300)
def test_sigterm_of_an_agent_leaves_at_once_and_the_other_goes_on(etcd: str, unique_job: str,
                                                                  tmp_path: Path) -> None:
    """Two agents (``--nnodes=1:2``); SIGTERM to the group-rank-0 agent (whose worker hosts
    the workers' store). It stops its worker and exits by itself (torch's launcher exits 1 on
    a signal, with c10d too); its etcd keys go at once, not a lease TTL later, and the
    rendezvous stays open. The lease TTL and the last call are both 30 s here, so the
    survivor's next round can only form within seconds because the leaver deleted its keys
    ("every live agent waits"). The survivor trains on alone and finishes with 0."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    conf = "lease_ttl=30,last_call_timeout=30"
    procs: list[subprocess.Popen] = []
    try:
        for i in range(2):
            procs.append(_agent(etcd, unique_job, out, 40, logs[i], nnodes="1:2", conf=conf))
        _wait(lambda: _step(out) >= 5, 90, "two agents train 5 steps", procs, logs)
        assert [w for _, _, w in _rounds(out)] == [2, 2], _rounds(out)
        rank0 = int((out / "rank0").read_text().split()[0])
        leaver, stayer = sorted(procs, key=lambda p: p.pid != rank0)
        i_leaver = procs.index(leaver)
        os.kill(leaver.pid, signal.SIGTERM)  # the agent only, as `kill <pid>` of a launcher
        leaver.wait(45)
        left_at = time.monotonic()
        assert leaver.returncode >= 0, "exited by itself, not killed by the signal"
        assert "got signal: 15" in logs[i_leaver].read_text()
        _wait(lambda: leaver.pid not in _agent_pids(etcd, unique_job, "agents/"), 5,
              "the leaver's agent key is gone (30 s lease: deleted, not expired)", procs, logs)
        _wait(lambda: _round(etcd, unique_job)["round"] >= 2, 15,
              "the survivor's round without the leaver", procs, logs)
        assert time.monotonic() - left_at < 15  # the last call (30 s) did not form it
        assert len(_round(etcd, unique_job)["members"]) == 1
        _wait(lambda: stayer.poll() is not None, 90, "the survivor finishes", procs, logs)
        assert stayer.returncode == 0, _tails(logs)
        assert (out / "done").read_text() == "1"
        assert _step(out) == 40
        assert _rounds(out)[-1] == (0, stayer.pid, 1)
    finally:
        _kill_all(procs)


@requires_entry_point
@pytest.mark.timeout(300)
def test_a_new_agent_joins_a_running_job(etcd: str, unique_job: str, tmp_path: Path) -> None:
    """One agent trains alone (``--nnodes=1:2``); a second agent starts mid-run. The running
    agent sees it waiting (``num_nodes_waiting``), restarts its worker, and the group grows
    to two, ranked by age (the first agent stays rank 0); the workers only finish in a group
    of two. Without ``--local-addr``: MASTER_ADDR comes from netaddr."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    kw = {"nnodes": "1:2", "conf": "lease_ttl=3,last_call_timeout=1", "finish_world": 2,
          "local_addr": False}
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_agent(etcd, unique_job, out, 20, logs[0], **kw))  # type: ignore[arg-type]
        _wait(lambda: _step(out) >= 5, 90, "the first agent trains alone", procs, logs)
        assert _rounds(out) == [(0, procs[0].pid, 1)]
        procs.append(_agent(etcd, unique_job, out, 20, logs[1], **kw))  # type: ignore[arg-type]
        _wait(lambda: all(p.poll() is not None for p in procs), 120, "both agents finish",
              procs, logs)
        assert [p.returncode for p in procs] == [0, 0], _tails(logs)
        rounds = _rounds(out)
        assert rounds[0] == (0, procs[0].pid, 1)
        assert sorted(rounds[1:]) == [(0, procs[0].pid, 2), (1, procs[1].pid, 2)], rounds
        assert (out / "done").read_text() == "2"
        assert _step(out) >= 20
        # No --local-addr: MASTER_ADDR is netaddr's choice (etcd on loopback: 127.0.0.1),
        # not torch's socket.getfqdn().
        assert (out / "rank0").read_text().split()[2] == "127.0.0.1"
    finally:
        _kill_all(procs)


@requires_entry_point
@pytest.mark.timeout(300)
def test_agents_beyond_max_nnodes_stand_by_step_in_and_exit_with_the_job(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    """Four agents, ``--nnodes=1:2``: two form the round, the other two wait as standbys
    (their ``waiting/`` keys) and neither disturb the running group (``num_nodes_waiting()``
    is 0 at MAX) nor form a group of their own beside it. SIGKILL of the rank-0 agent and its
    worker: once its lease is gone (3 s), the two oldest waiting agents form the next round,
    at least one of them a former standby. When the job finishes, the agents close the
    rendezvous and the agent still standing by exits 0."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(4)]
    # etcd_outage_s=3: the killed member may train 3 s + lease_ttl after its key is gone.
    kw = {"nnodes": "1:2", "conf": "lease_ttl=3,last_call_timeout=30,etcd_outage_s=3"}
    procs: list[subprocess.Popen] = []
    try:
        for i in range(4):
            procs.append(_agent(etcd, unique_job, out, 50, logs[i], **kw))  # type: ignore[arg-type]
        _wait(lambda: _step(out) >= 10, 120, "the first round trains 10 steps", procs, logs)
        first = _rounds(out)
        assert sorted(r[0] for r in first) == [0, 1] and {r[2] for r in first} == {2}, first
        members = {pid for _, pid, _ in first}
        standbys = {p.pid for p in procs} - members
        _wait(lambda: _agent_pids(etcd, unique_job, "waiting/") == standbys, 30,
              "the two other agents wait as standbys", procs, logs)
        assert _round(etcd, unique_job)["round"] == 1
        agent_pid, worker_pid = map(int, (out / "rank0").read_text().split()[:2])
        dead = next(p for p in procs if p.pid == agent_pid)
        os.killpg(agent_pid, signal.SIGKILL)
        os.killpg(worker_pid, signal.SIGKILL)
        dead.wait(10)
        _wait(lambda: len(_rounds(out)) >= 4, 90, "the second round starts its workers",
              procs, logs)
        second = _rounds(out)[2:4]
        assert {r[2] for r in second} == {2} and agent_pid not in {r[1] for r in second}
        assert {r[1] for r in second} & standbys, "a standby stepped in"
        rest = [p for p in procs if p is not dead]
        _wait(lambda: all(p.poll() is not None for p in rest), 120,
              "every other agent exits, the one still standing by too", procs, logs)
        assert [p.returncode for p in rest] == [0, 0, 0], _tails(logs)
        idle = ({p.pid for p in rest} - {r[1] for r in second}).pop()
        assert "finished while this agent waited" in logs[procs.index(
            next(p for p in procs if p.pid == idle))].read_text()
        assert (out / "done").read_text() == "2" and _step(out) == 50
        assert len(_rounds(out)) == 4  # no other worker start
    finally:
        _kill_all(procs)


@requires_entry_point
@pytest.mark.timeout(300)
def test_an_etcd_outage_of_15_s_does_not_restart_the_workers(fresh_etcd,
                                                            tmp_path: Path) -> None:
    """Two agents train; etcd is down for 15 s (killed, then started on its data). The
    workers never need etcd while they train, and the agents' monitor loops answer from
    their last ``num_nodes_waiting()`` (``etcd_outage_s`` 40), so the workers train on
    through the outage, are never restarted, and the job finishes with exit status 0."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    kw = {"nnodes": "2:2", "conf": "lease_ttl=3,last_call_timeout=2,etcd_outage_s=40"}
    endpoint = fresh_etcd.endpoint
    procs: list[subprocess.Popen] = []
    try:
        for i in range(2):
            procs.append(_agent(endpoint, "outage", out, 250, logs[i], **kw))  # type: ignore[arg-type]
        _wait(lambda: _step(out) >= 10, 120, "two agents train 10 steps", procs, logs)
        assert len(_rounds(out)) == 2
        fresh_etcd.kill()
        at_kill = _step(out)
        time.sleep(15)  # the outage itself
        during = _step(out) - at_kill
        fresh_etcd.start()
        assert all(p.poll() is None for p in procs), _tails(logs)
        _wait(lambda: all(p.poll() is not None for p in procs), 200, "both agents finish",
              procs, logs)
        assert [p.returncode for p in procs] == [0, 0], _tails(logs)
        assert during >= 10, f"only {during} steps during the outage"
        assert len(_rounds(out)) == 2, _rounds(out)  # no worker restart
        assert (out / "done").read_text() == "2" and _step(out) == 250
        assert all("etcd does not answer" in log.read_text() for log in logs), _tails(logs)
    finally:
        _kill_all(procs)
        if not fresh_etcd.running:
            fresh_etcd.start()


@requires_entry_point
@pytest.mark.timeout(360)
def test_a_round_whose_agents_lost_their_leases_is_not_replaced_while_it_trains(
        etcd: str, unique_job: str, tmp_path: Path) -> None:
    """Four agents, ``--nnodes=2:2``: two train, two stand by. Both member agents are frozen
    (SIGSTOP; their workers train on) and their leases revoked, as after a partition longer
    than ``lease_ttl``: their keys are gone while their workers still train. The standbys
    do not form a round beside them (``etcd_outage_s + lease_ttl`` = 11 s is not over). The
    members come back (SIGCONT) before that, find their keys gone, stop their workers and
    rendezvous again; the job then finishes and every agent exits 0.

    A real network partition (netns) would cut the agents off instead of freezing them; the
    rule is the same: what the standbys see is a member's key gone while it still trains."""
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(4)]
    kw = {"nnodes": "2:2", "conf": "lease_ttl=3,last_call_timeout=2,etcd_outage_s=8"}
    procs: list[subprocess.Popen] = []
    stopped: list[int] = []
    try:
        for i in range(4):
            procs.append(_agent(etcd, unique_job, out, 200, logs[i], **kw))  # type: ignore[arg-type]
        _wait(lambda: _step(out) >= 10, 150, "the first round trains 10 steps", procs, logs)
        members = {pid for _, pid, _ in _rounds(out)}
        standbys = {p.pid for p in procs} - members
        _wait(lambda: _agent_pids(etcd, unique_job, "waiting/") == standbys, 60,
              "the two other agents wait as standbys", procs, logs)
        prefix = run_prefix(unique_job) + "agents/"
        with EtcdClient(etcd) as client:
            kvs, _ = client.get_prefix(prefix)
            leases = [kv.lease for kv in kvs if json.loads(kv.value)["pid"] in members]
            assert len(leases) == 2
            for pid in members:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            for lease in leases:
                client.revoke(lease)
        cut = time.monotonic()
        step_at_cut = _step(out)
        while time.monotonic() - cut < 6:  # well inside the 11 s the standbys must wait
            assert _round(etcd, unique_job)["round"] == 1, "a round formed beside the one training"
            assert len(_rounds(out)) == 2, _rounds(out)
            time.sleep(0.1)
        assert _step(out) > step_at_cut, "the frozen agents' workers train on"
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        _wait(lambda: all(p.poll() is not None for p in procs), 240, "every agent exits",
              procs, logs)
        assert [p.returncode for p in procs] == [0, 0, 0, 0], _tails(logs)
        assert (out / "done").read_text() == "2" and _step(out) == 200
        back = [logs[i].read_text() for i, p in enumerate(procs) if p.pid in members]
        assert all("its key is gone" in text for text in back), _tails(logs)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        _kill_all(procs)


# --- in-process: the handler and the store, no torchrun -------------------------------------


def _params(etcd: str, job: str, min_nodes: int, max_nodes: int, **conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(BACKEND, etcd, job, min_nodes, max_nodes,
                                local_addr="127.0.0.1", **conf)


def test_store_semantics(etcd: str, unique_job: str) -> None:
    """The round's store is peer_elastic's EtcdStore (the one Store of the project), under the
    round's prefix and the job lease."""
    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    handler = PeerElasticRendezvousHandler(_params(etcd, unique_job, 1, 1))
    try:
        _check_round_store(handler.next_rendezvous().store, unique_job)
    finally:
        handler.shutdown()


def test_torchruns_default_rendezvous_id_is_warned_about(etcd: str, caplog) -> None:
    """Left out, --rdzv-id is "none" (torchrun's and accelerate's default): every job that
    forgot it would meet in one rendezvous, so the agent says so."""
    from peer_elastic.torchrun import TORCHRUN_DEFAULT_RUN_ID, PeerElasticRendezvousHandler

    with caplog.at_level("WARNING", logger="peer_elastic.torchrun"):
        handler = PeerElasticRendezvousHandler(_params(etcd, TORCHRUN_DEFAULT_RUN_ID, 1, 1))
        handler.shutdown()
    assert any("--rdzv-id" in r.getMessage() for r in caplog.records), caplog.text


def _check_round_store(store, job: str) -> None:
    import datetime

    from torch.distributed import DistStoreError

    from peer_elastic.torch.store import EtcdStore

    assert isinstance(store, EtcdStore)
    assert store.prefix == run_prefix(job) + "store/1/"
    assert store.lease_id is not None
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
    before = store.num_keys()
    assert store.delete_key("a") and store.num_keys() == before - 1


def test_store_add_counts_once_when_etcd_answers_are_lost(etcd: str, unique_job: str) -> None:
    """etcd applies the store's compare-and-put of ``add`` and the answer is lost; the client
    retries. The counter still counts once, so torch's exit barrier (two agents, every
    first answer to a store transaction lost) completes instead of waiting out its timeout."""
    import threading

    from torch.distributed.elastic.utils.store import barrier

    from peer_elastic.etcd.client import FaultInjection
    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    clients = [EtcdClient(etcd) for _ in range(2)]
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 2), client=c)
                for c in clients]
    infos: dict[int, object] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: infos.__setitem__(
            i, handlers[i].next_rendezvous()), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert set(infos) == {0, 1}
        store_prefix = run_prefix(unique_job) + "store/1/"
        lost: list[str] = []

        def lose_first_answer(what: str) -> bool:
            if what.startswith("transaction") and store_prefix in what and what not in lost:
                lost.append(what)
                return True
            return False

        for c in clients:
            c.faults = FaultInjection(lose_response=lose_first_answer)
        store = infos[0].store
        assert store.add("counter", 1) == 1
        assert store.add("counter", 0) == 1  # applied once, although retried
        assert lost, "no answer was dropped: the test did not provoke a retry"
        errors: list[BaseException] = []

        def exit_barrier(i: int) -> None:
            try:
                barrier(infos[i].store, 2, key_prefix="torchelastic/agent/terminal_state",
                        barrier_timeout=20, rank=i)
            except BaseException as exc:
                errors.append(exc)

        t0 = time.monotonic()
        threads = [threading.Thread(target=exit_barrier, args=(i,), daemon=True)
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and time.monotonic() - t0 < 15, errors
    finally:
        for h in handlers:
            h.shutdown()


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


def _rendezvous_alone(etcd: str, job: str, local_addr: str | None):
    """One handler (``--nnodes=1``) through one round; its RendezvousInfo."""
    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    params = _params(etcd, job, 1, 1)
    params.local_addr = local_addr
    handler = PeerElasticRendezvousHandler(params)
    try:
        return handler.next_rendezvous()
    finally:
        handler.shutdown()


def test_master_addr_is_chosen_by_netaddr(etcd: str, unique_job: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``--local-addr``, rank 0 publishes the address netaddr.select_address picks
    for the etcd endpoints (not torch's socket.getfqdn()); ``--local-addr`` still wins."""
    import peer_elastic.torchrun as tr
    from peer_elastic.process.netaddr import NetChoice

    asked: list[list[tuple[str, int]]] = []

    def fake_select(endpoints, **kw):
        asked.append(list(endpoints))
        return NetChoice("10.9.8.7", "eth9", "route to etcd")

    monkeypatch.setattr(tr, "select_address", fake_select)
    info = _rendezvous_alone(etcd, unique_job + "-a", None)
    assert info.bootstrap_store_info.master_addr == "10.9.8.7"
    host, port = etcd.split(",")[0].rsplit(":", 1)
    assert asked == [[(host, int(port))]]
    info = _rendezvous_alone(etcd, unique_job + "-b", "127.0.0.1")
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"


def test_master_addr_honours_peer_elastic_addr_and_sets_gloo(
        etcd: str, unique_job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real selection: etcd on loopback gives 127.0.0.1 and leaves gloo alone;
    PEER_ELASTIC_ADDR gives that address and hands its interface to the workers' gloo through
    the agent's environment (GLOO_SOCKET_IFNAME); an address not on this machine fails the
    rendezvous with the ConfigError a peer would get."""
    from peer_elastic.errors import ConfigError
    from peer_elastic.process.netaddr import GLOO_IFNAME, NCCL_IFNAME

    saved = {k: os.environ.get(k) for k in (GLOO_IFNAME, NCCL_IFNAME)}
    for name in ("PEER_ELASTIC_ADDR", "PEER_ELASTIC_IFNAME", GLOO_IFNAME, NCCL_IFNAME):
        monkeypatch.delenv(name, raising=False)
    try:
        info = _rendezvous_alone(etcd, unique_job + "-a", None)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert GLOO_IFNAME not in os.environ
        monkeypatch.setenv("PEER_ELASTIC_ADDR", "127.0.0.1")
        info = _rendezvous_alone(etcd, unique_job + "-b", None)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert os.environ[GLOO_IFNAME] == "lo"
        monkeypatch.setenv("PEER_ELASTIC_ADDR", "192.0.2.77")
        with pytest.raises(ConfigError, match="192.0.2.77"):
            _rendezvous_alone(etcd, unique_job + "-c", None)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_standbys_never_form_a_round_beside_a_running_one(etcd: str, unique_job: str) -> None:
    """MIN=MAX=2, four handlers: 0 and 1 form round 1 and "train" (they do not wait); 2 and
    3 wait as standbys and, although two of them wait (MIN and MAX met), write no round of
    their own beside the running one. Then 1 comes back (its worker failed): the round is
    broken, and ``last_call_timeout`` later the oldest waiting agents (1, 2) form round 2
    without 0, which never came back. Closing the rendezvous (the job finished) makes the
    remaining standby leave with SystemExit(0)."""
    import threading

    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    conf = {"last_call_timeout": 0.5, "lease_ttl": 5, "settle": 0.1}
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 2, **conf))
                for _ in range(4)]
    infos: dict[int, object] = {}

    def rdzv(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except SystemExit as exc:
            infos[i] = exc

    def run(*which: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=rdzv, args=(i,), daemon=True) for i in which]
        for t in threads:
            t.start()
        return threads

    try:
        for t in run(0, 1):
            t.join(30)
        assert sorted((infos[i].rank, infos[i].world_size) for i in (0, 1)) == [(0, 2), (1, 2)]
        standbys = run(2, 3)
        deadline = time.monotonic() + 20
        while len(_keys(etcd, unique_job, "waiting/")) < 2:
            assert time.monotonic() < deadline, "the standbys never waited"
            time.sleep(0.05)
        assert handlers[0].num_nodes_waiting() == 0  # at MAX: no restart for standbys
        # Two agents wait, MIN and MAX are met, the last call passes three times over: still
        # no round, since both members of round 1 still train in it.
        time.sleep(3 * conf["last_call_timeout"])
        assert _round(etcd, unique_job)["round"] == 1
        assert not infos.keys() & {2, 3}
        back = run(1)
        back[0].join(30)
        rnd = _round(etcd, unique_job)
        assert rnd["round"] == 2
        assert (infos[1].rank, infos[1].world_size) == (0, 2)
        ids = [h.agent_id for h in handlers]
        assert rnd["members"][0] == ids[1] and rnd["members"][1] in (ids[2], ids[3])
        stepped_in = ids.index(rnd["members"][1])
        standbys[stepped_in - 2].join(30)
        assert (infos[stepped_in].rank, infos[stepped_in].world_size) == (1, 2)
        idle = ({2, 3} - {stepped_in}).pop()
        assert idle not in infos  # still standing by
        handlers[1].set_closed()
        standbys[idle - 2].join(30)
        assert isinstance(infos[idle], SystemExit) and infos[idle].code == 0
    finally:
        for h in handlers:
            h.shutdown()


# --- etcd faults ----------------------------------------------------------------------------


def _rdzv_threads(handlers, which, infos: dict) -> list:
    """next_rendezvous() of ``handlers[i]`` for each i in ``which``, each on a daemon thread;
    the outcome (RendezvousInfo or the exception) lands in ``infos[i]``."""
    import threading

    def rdzv(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # SystemExit too: a standby told the job finished
            infos[i] = exc

    threads = [threading.Thread(target=rdzv, args=(i,), daemon=True) for i in which]
    for t in threads:
        t.start()
    return threads


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def test_records_are_parsed_strictly() -> None:
    from peer_elastic.torchrun import RoundRecord, parse_lease_id, parse_round, parse_waiting

    assert parse_round(b'{"round": 3, "members": ["a", "b"]}') == RoundRecord(3, ("a", "b"))
    assert parse_round(RoundRecord(7, ("x",)).encode()) == RoundRecord(7, ("x",))
    for junk in (b"", b"\xff\xfe", b"null", b"[]", b'"round"', b'{"round": "3"}',
                 b'{"round": 3}', b'{"round": 0, "members": ["a"]}',
                 b'{"round": true, "members": ["a"]}', b'{"round": 2, "members": []}',
                 b'{"round": 2, "members": ["a", "a"]}', b'{"round": 2, "members": [1]}',
                 b'{"round": 2.5, "members": ["a"]}', b"\x80\x04K\x01."):  # the last: a pickle
        assert parse_round(junk) is None, junk
    assert parse_round(RoundRecord(2**62 + 1, ("x",)).encode()) is not None
    assert parse_round(RoundRecord(2**62 + 2, ("x",)).encode()) is None
    assert parse_waiting(b'{"after": 4}') == 4
    for junk in (b"", b'{"after": -1}', b'{"after": "4"}', b"4", b'{"after": null}'):
        assert parse_waiting(junk) is None, junk
    assert parse_lease_id(b"7587869355371123") == 7587869355371123
    for junk in (b"", b"-5", b"0", b"12a", b" 12", b"\xff", b"99999999999999999999", "٣".encode()):
        assert parse_lease_id(junk) is None, junk


def test_malformed_round_and_lease_values_are_ignored(etcd: str, unique_job: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Junk in ``lease``, ``round`` and a ``waiting/`` key (as a foreign writer or a torn
    value would leave): the agents log it once, treat it as absent, replace it, and form
    round 1; ``num_nodes_waiting()`` never raises."""
    from peer_elastic.torchrun import PeerElasticRendezvousHandler, parse_lease_id

    prefix = run_prefix(unique_job)
    with EtcdClient(etcd) as client:
        client.put(prefix + "lease", b"not-a-lease")
        client.put(prefix + "round", b"\x80\x04K\x01.")  # a pickle: never unpickled
        client.put(prefix + "waiting/ghost", b"{oops")
        client.put(prefix + "waiting/ghost2", b'{"after": 4611686018427387904}')  # no agent
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 2,
                                                     last_call_timeout=0.5)) for _ in range(2)]
    infos: dict[int, object] = {}
    try:
        with caplog.at_level("WARNING", logger="peer_elastic.torchrun"):
            for t in _rdzv_threads(handlers, (0, 1), infos):
                t.join(30)
            assert sorted((infos[i].rank, infos[i].world_size) for i in (0, 1)) == \
                [(0, 2), (1, 2)], infos
            assert _round(etcd, unique_job)["round"] == 1
            with EtcdClient(etcd) as client:
                client.put(prefix + "round", b'{"round": "x"}')
            for _ in range(3):
                assert handlers[0].num_nodes_waiting() == 0
        with EtcdClient(etcd) as client:
            kv = client.get(prefix + "lease")
        assert kv is not None and parse_lease_id(kv.value) is not None
        malformed = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        for what in ("job lease id", "round record", "waiting record"):
            assert any(what in m for m in malformed), malformed
        # Once per key and value in each agent, not once per poll.
        assert all(malformed.count(m) <= 2 for m in malformed), malformed
    finally:
        for h in handlers:
            h.shutdown()


def test_round_numbers_never_go_backwards_after_the_job_lease_expires(
        etcd: str, unique_job: str) -> None:
    """MIN=MAX=2: agents 0 and 1 train in round 1, agent 2 stands by (it saw round 1). The
    job lease expires (revoked here): ``round`` and the store go with it. Agent 0 comes
    back; the next round is 2, not 1 again, so the standby recognises it at once instead of
    waiting out ``join_timeout`` for a round after 1."""
    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    conf = {"last_call_timeout": 0.5, "lease_ttl": 5, "join_timeout": 60}
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 2, **conf))
                for _ in range(3)]
    infos: dict[int, object] = {}
    try:
        for t in _rdzv_threads(handlers, (0, 1), infos):
            t.join(30)
        assert {i for i in infos} == {0, 1}
        standby = _rdzv_threads(handlers, (2,), infos)[0]
        _until(lambda: len(_keys(etcd, unique_job, "waiting/")) == 1, 20, "the standby waits")
        prefix = run_prefix(unique_job)
        with EtcdClient(etcd) as client:
            client.revoke(int(client.get(prefix + "lease").value))
            assert client.get(prefix + "round") is None
        t0 = time.monotonic()
        back = _rdzv_threads(handlers, (0,), infos)[0]
        back.join(30)
        standby.join(30)
        assert time.monotonic() - t0 < 20
        assert (infos[0].rank, infos[2].rank) == (0, 1), infos
        assert _round(etcd, unique_job)["round"] == 2
        assert infos[2].store.prefix == prefix + "store/2/"
    finally:
        for h in handlers:
            h.shutdown()


def test_standbys_wait_out_a_cut_off_round_before_replacing_it(etcd: str,
                                                               unique_job: str) -> None:
    """MIN=MAX=2: agents 0 and 1 train in round 1; 2 and 3 stand by. Both members' leases
    expire (revoked here, as after a partition longer than ``lease_ttl``: their keys vanish
    while their workers may still train). The standbys do not form round 2 until the
    members may have stopped (``etcd_outage_s + lease_ttl`` after they saw the keys go);
    the cut-off agents themselves answer ``num_nodes_waiting() == 1`` once they reach etcd
    again, which makes torch stop their workers. A member that left gracefully (its
    ``left/`` marker) is not waited for."""
    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    conf = {"last_call_timeout": 0.3, "lease_ttl": 2, "etcd_outage_s": 4, "settle": 0.1}
    handlers = [PeerElasticRendezvousHandler(_params(etcd, unique_job, 2, 2, **conf))
                for _ in range(4)]
    hold = conf["etcd_outage_s"] + conf["lease_ttl"]  # the handler's silence_hold_s
    infos: dict[int, object] = {}
    try:
        for t in _rdzv_threads(handlers, (0, 1), infos):
            t.join(30)
        standbys = _rdzv_threads(handlers, (2, 3), infos)
        _until(lambda: len(_keys(etcd, unique_job, "waiting/")) == 2, 20, "the standbys wait")
        assert handlers[0].num_nodes_waiting() == 0
        with EtcdClient(etcd) as client:
            for h in handlers[:2]:
                client.revoke(h._agent.lease_id)
        gone = time.monotonic()
        _until(lambda: not _keys(etcd, unique_job, "agents/").keys()
               & {h.agent_id for h in handlers[:2]}, 10, "the members' keys are gone")
        # The members' keys are gone; their workers may still train: no round yet.
        while time.monotonic() - gone < hold - 1.5:
            assert _round(etcd, unique_job)["round"] == 1
            time.sleep(0.1)
        assert not infos.keys() & {2, 3}
        # The cut-off agents stop their workers once they see their own key gone.
        assert handlers[0].num_nodes_waiting() == 1 and handlers[1].num_nodes_waiting() == 1
        for t in standbys:
            t.join(30)
        assert time.monotonic() - gone >= hold - 1.5
        assert sorted((infos[i].rank, infos[i].world_size) for i in (2, 3)) == \
            [(0, 2), (1, 2)], infos
        assert _round(etcd, unique_job)["round"] == 2
        # Graceful: agent 2 leaves (shutdown: its workers are stopped) and says so; the
        # other member comes back and, with agent 0 waiting too, round 3 forms at once.
        handlers[2].shutdown()
        t0 = time.monotonic()
        for t in _rdzv_threads(handlers, (3, 0), infos):
            t.join(30)
        assert time.monotonic() - t0 < hold - 1
        assert _round(etcd, unique_job)["round"] == 3
    finally:
        for h in handlers:
            h.shutdown()


def test_an_etcd_outage_costs_nothing_up_to_etcd_outage_s(fresh_etcd) -> None:
    """etcd down for 8 s (``etcd_outage_s`` 30): ``num_nodes_waiting()`` answers at once from
    its last answer (logged once); a rendezvous started during the outage goes through once
    etcd is back. Then etcd down with ``etcd_outage_s`` 3: ``next_rendezvous()`` ends with a
    RendezvousConnectionError that names the setting, and ``num_nodes_waiting()`` answers 1
    (stop the workers) once etcd has been silent that long."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from peer_elastic.torchrun import PeerElasticRendezvousHandler

    endpoint = fresh_etcd.endpoint
    conf = {"last_call_timeout": 0.3, "lease_ttl": 3, "etcd_outage_s": 30}
    handlers = [PeerElasticRendezvousHandler(_params(endpoint, "outage", 1, 3, **conf))
                for _ in range(2)]
    infos: dict[int, object] = {}
    try:
        for t in _rdzv_threads(handlers, (0,), infos):
            t.join(30)
        assert infos[0].world_size == 1
        assert handlers[0].num_nodes_waiting() == 0
        fresh_etcd.kill()
        down = time.monotonic()
        late = _rdzv_threads(handlers, (1,), infos)[0]  # a newcomer during the outage
        while time.monotonic() - down < 8:
            t0 = time.monotonic()
            assert handlers[0].num_nodes_waiting() == 0
            assert time.monotonic() - t0 < 4  # answers, does not wait out the outage
            time.sleep(0.5)
        fresh_etcd.start()
        _until(lambda: handlers[0].num_nodes_waiting() == 1, 30, "the newcomer is seen")
        for t in _rdzv_threads(handlers, (0,), infos):
            t.join(30)
        late.join(30)
        assert sorted((infos[i].rank, infos[i].world_size) for i in (0, 1)) == \
            [(0, 2), (1, 2)], infos
        short = PeerElasticRendezvousHandler(_params(endpoint, "outage-short", 1, 1,
                                                     etcd_outage_s=3, lease_ttl=3))
        handlers.append(short)
        for t in _rdzv_threads(handlers, (2,), infos):
            t.join(30)
        assert short.num_nodes_waiting() == 0
        fresh_etcd.kill()
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="etcd_outage_s"):
            short.next_rendezvous()
        assert time.monotonic() - t0 < 20
        _until(lambda: short.num_nodes_waiting() == 1, 20, "stop the workers")
    finally:
        if not fresh_etcd.running:
            fresh_etcd.start()
        for h in handlers:
            h.shutdown()
