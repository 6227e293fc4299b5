"""A torchrun rendezvous backend on etcd v3: ``torchrun --rdzv-backend=peer-elastic``.

::

    torchrun --rdzv-backend=peer-elastic --rdzv-endpoint=HOST:2379[,HOST:2379] \\
             --rdzv-id=JOB --nnodes=MIN:MAX --nproc-per-node=N train.py

Registered through torch's ``torchrun.handlers`` entry-point group (see ``pyproject.toml``):
torch calls :func:`register` with no arguments and uses what it returns to build a
:class:`PeerElasticRendezvousHandler` from the ``RendezvousParameters``.

Why: torch's in-tree ``etcd`` / ``etcd-v2`` backends speak the etcd v2 API, which etcd 3.6
no longer serves (pytorch#158326, #170707), and ``c10d`` keeps its whole state in a TCPStore
inside the first agent, so losing that agent ends the job for every agent (pytorch#67742).
Here all state lives in etcd; no agent is special.

Keys (``P = /peer-elastic-torchrun/<run id>/``)::

    P lease              the job lease id (attached to itself; every agent keeps it alive)
    P agents/<agent>     one per live agent (agent lease): its age is its create revision
    P waiting/<agent>    an agent inside next_rendezvous() (agent lease)
    P round              {"round": n, "members": [...]}, oldest agent first (job lease; CAS)
    P store/<n>/<key>    the torch Store of round n (job lease)
    P closed             set_closed() (job lease)

The oldest *waiting* agent (smallest create revision of its ``agents/`` key) writes the next
round when at least ``min_nodes`` wait and either ``max_nodes`` wait, every live agent waits
(after ``settle``), or the set of waiting agents has been unchanged for ``last_call_timeout``;
but never while every live member of the current round still trains in it (none has come
back to wait): standbys and newcomers do not start a group beside a running one. A member
that is not back ``last_call_timeout`` after another is (its key not yet expired) is left out. Ranks follow age, so the oldest agent is group rank 0.
A dead agent's keys vanish with its lease (``lease_ttl``); an agent that exits (SIGTERM
included) deletes them at once; nothing else depends on any one agent.

Agents beyond ``max_nodes`` stand by: they wait in ``waiting/`` without disturbing the
running round (``num_nodes_waiting()`` is 0 at ``max_nodes``), take a place in the next round
when a member is lost (oldest first), and exit 0 when the job finishes (the rendezvous is
closed) or fail after ``join_timeout``.

Group rank 0 publishes MASTER_ADDR: torchrun's ``--local-addr`` if given, otherwise the
address :mod:`peer_elastic.netaddr` chooses, as for a peer (``PEER_ELASTIC_ADDR``,
``PEER_ELASTIC_IFNAME``, else the interface that routes to the etcd endpoints), whose
interface each agent also hands to its workers' gloo (``GLOO_SOCKET_IFNAME``).

``--rdzv-conf`` keys: ``lease_ttl`` (5 s), ``last_call_timeout`` (2 s), ``settle`` (0.3 s),
``join_timeout`` (600 s), ``run_ttl`` (60 s: how long the job's keys outlive its last agent),
``store_timeout`` (300 s). TLS and auth come from the ``PEER_ELASTIC_ETCD_*`` variables, as
for every peer; without ``--rdzv-endpoint``, ``PEER_ELASTIC_ETCD`` names the endpoints.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any


def register() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments.

    Defined before this module imports torch's rendezvous package: importing that package
    loads every ``torchrun.handlers`` entry point, this one included, so a program that
    imports ``peer_elastic.torchrun`` first finds it half-imported; ``register`` (and the
    factory it returns, which looks :func:`create_handler` up when called) must exist by then.
    """
    return _create_handler


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return create_handler(params)


from torch.distributed import DistStoreError, Store  # noqa: E402 - after register (above)
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from peer_elastic.errors import EtcdError, LeaseNotFound  # noqa: E402
from peer_elastic.etcd.client import EtcdClient, KeyValue, Txn, client_from_env  # noqa: E402
from peer_elastic.etcd.lease import LeaseKeeper, Session  # noqa: E402
from peer_elastic.etcd.watch import PrefixWatch  # noqa: E402
from peer_elastic.netaddr import NetChoice, select_address  # noqa: E402

log = logging.getLogger(__name__)

BACKEND = "peer-elastic"
ROOT = "/peer-elastic-torchrun/"
# torch's exit barrier (torch/distributed/elastic/agent/server/api.py, utils/store.py): its
# last-member key in a round's store means the job finished there.
_EXIT_BARRIER_DONE = "torchelastic/agent/terminal_state/last_member"
_POLL_S = 0.2


def run_prefix(run_id: str) -> str:
    return f"{ROOT}{urllib.parse.quote(run_id, safe='')}/"


class EtcdV3Store(Store):
    """A torch ``Store`` on etcd v3 keys under ``prefix`` (what the agents of one round share).

    Blocking ``get``/``wait`` poll with a short interval; counters (``add``) are decimal text,
    as in TCPStore. Keys are attached to ``lease`` (the job lease) so they do not outlive the job.
    """

    def __init__(self, client: EtcdClient, prefix: str, lease: Callable[[], int | None],
                 timeout_s: float = 300.0) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._lease = lease
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _key(self, key: str) -> str:
        return self._prefix + key

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key: str, value: Any) -> None:
        self._client.put(self._key(key), self._bytes(value), lease=self._lease())

    def _wait_get(self, keys: list[str], timeout: datetime.timedelta | None) -> list[bytes]:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.01
        while True:
            values = [self._client.get(self._key(k)) for k in keys]
            if all(v is not None for v in values):
                return [v.value for v in values if v is not None]
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise DistStoreError(
                    f"timed out after {limit:.0f} s waiting for store keys {missing} "
                    f"under {self._prefix}")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def get(self, key: str) -> bytes:
        return self._wait_get([key], None)[0]

    def wait(self, keys: list[str], override_timeout: datetime.timedelta | None = None) -> None:
        self._wait_get(list(keys), override_timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def add(self, key: str, num: int) -> int:
        full = self._key(key)
        while True:
            kv = self._client.get(full)
            value = (int(kv.value) if kv is not None else 0) + int(num)
            if self._client.compare_and_put(full, str(value).encode(),
                                            kv.mod_revision if kv is not None else 0,
                                            lease=self._lease()):
                return value

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        full = self._key(key)
        expected, desired = self._bytes(expected_value), self._bytes(desired_value)
        guard = (Txn.version(full) == 0) if not expected else (Txn.value(full) == expected)
        ok, resp = self._client.txn([guard], [Txn.put(full, desired, self._lease())],
                                    [Txn.get(full)])
        if ok:
            return desired
        return resp[0][0].value if resp and resp[0] else expected

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        return len(self._client.get_prefix(self._prefix)[0])


class PeerElasticRendezvousHandler(RendezvousHandler):
    """torchrun's ``RendezvousHandler`` on etcd v3; see the module docstring."""

    def __init__(self, params: RendezvousParameters, client: EtcdClient | None = None) -> None:
        self._params = params
        self._run_id = params.run_id
        self._min = max(1, params.min_nodes)
        self._max = max(self._min, params.max_nodes)
        self._lease_ttl = float(params.get("lease_ttl", 5.0))
        self._last_call = float(params.get("last_call_timeout", 2.0))
        self._settle = float(params.get("settle", 0.3))
        self._join_timeout = float(params.get("join_timeout", 600.0))
        self._run_ttl = float(params.get("run_ttl", 60.0))
        self._store_timeout = float(params.get("store_timeout", 300.0))
        self._client = client or client_from_env(params.endpoint or None)
        self._prefix = run_prefix(self._run_id)
        host = socket.gethostname().split(".")[0] or "host"
        self.agent_id = f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
        self._keeper = LeaseKeeper(self._client, name="rdzv-lease-keeper")
        self._agent: Session | None = None
        self._job_lease: int | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watch: PrefixWatch | None = None
        self._round = 0
        self._store: EtcdV3Store | None = None
        self._net: NetChoice | None = None
        self._shut = False
        atexit.register(self._leave)

    # -- keys and leases ------------------------------------------------------------------------

    def _k(self, name: str) -> str:
        return self._prefix + name

    def _job_lease_id(self) -> int | None:
        """The job lease, created by the first agent and kept alive by every agent."""
        with self._lock:
            if self._job_lease is not None:
                return self._job_lease
            for _ in range(10):
                kv = self._client.get(self._k("lease"))
                if kv is not None:  # attached to itself: present means alive
                    lease_id = int(kv.value)
                else:
                    lease_id = self._client.grant(self._run_ttl)
                    if not self._client.compare_and_put(self._k("lease"), str(lease_id).encode(),
                                                        0, lease=lease_id):
                        self._client.revoke(lease_id)
                        continue
                self._keeper.keep(lease_id, self._run_ttl, self._job_lease_lost)
                self._job_lease = lease_id
                return lease_id
            raise EtcdError(f"could not agree on a job lease under {self._prefix}")

    def _job_lease_lost(self, lease_id: int, why: str) -> None:
        with self._lock:
            if self._job_lease == lease_id:
                self._job_lease = None

    def _with_job_lease(self, fn: Callable[[int | None], Any]) -> Any:
        try:
            return fn(self._job_lease_id())
        except LeaseNotFound:
            self._job_lease_lost(self._job_lease or 0, "lease not found")
            return fn(self._job_lease_id())

    def _register(self) -> Session:
        if self._agent is not None and not self._agent.lost.is_set():
            return self._agent
        if self._agent is not None:
            self._agent.close(revoke=False)
        self._job_lease_id()
        agent = Session(self._client, self._lease_ttl, keeper=self._keeper)
        info = {"host": socket.gethostname(), "pid": os.getpid()}
        self._client.put(self._k(f"agents/{self.agent_id}"), json.dumps(info).encode(),
                         lease=agent.lease_id)
        self._agent = agent
        if self._watch is None:
            wake = self._wake.set
            self._watch = PrefixWatch(self._client, self._prefix,
                                      on_snapshot=lambda kvs, rev: wake(),
                                      on_events=lambda events, rev: wake())
            self._watch.start()
        return agent

    def _address(self) -> NetChoice:
        """This agent's address, chosen once as a peer chooses its own (``netaddr``):
        ``PEER_ELASTIC_ADDR``, ``PEER_ELASTIC_IFNAME``, the user's ``GLOO_SOCKET_IFNAME``, or
        the interface that routes to the etcd endpoints. The interface goes to gloo (and
        nccl) through this process's environment, which torchrun's workers inherit."""
        if self._net is None:
            endpoints = [(e.host, e.port) for e in getattr(self._client, "endpoints", ())]
            self._net = select_address(endpoints)
            log.info("agent %s: address %s (%s%s)", self.agent_id,
                     self._net.address or "unknown", self._net.how,
                     f", interface {self._net.ifname}" if self._net.ifname else "")
        return self._net

    def master_addr(self) -> str:
        """What this agent publishes as MASTER_ADDR when it is group rank 0: torchrun's
        ``--local-addr`` if given, else :meth:`_address` (not torch's ``socket.getfqdn()``,
        which is 127.0.1.1 on many Debian/Ubuntu hosts)."""
        net = self._address()  # also for the interface it hands to gloo
        return self._params.local_addr or net.address or socket.getfqdn()

    # -- reading the state ------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        kvs, _ = self._client.get_prefix(self._prefix)
        agents: dict[str, KeyValue] = {}
        waiting: dict[str, KeyValue] = {}
        rnd: KeyValue | None = None
        closed = False
        for kv in kvs:
            name = kv.key[len(self._prefix):]
            if name.startswith("agents/"):
                agents[name[len("agents/"):]] = kv
            elif name.startswith("waiting/"):
                waiting[name[len("waiting/"):]] = kv
            elif name == "round":
                rnd = kv
            elif name == "closed":
                closed = True
        round_doc = json.loads(rnd.value) if rnd is not None else {"round": 0, "members": []}
        return {"agents": agents, "waiting": waiting, "round_kv": rnd, "round": round_doc,
                "closed": closed}

    # -- RendezvousHandler ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._client.get(self._k("closed")) is not None

    def set_closed(self) -> None:
        self._with_job_lease(lambda lease: self._client.put(self._k("closed"), b"1", lease=lease))

    def num_nodes_waiting(self) -> int:
        state = self._state()
        members = state["round"]["members"]
        if len(members) >= self._max:
            return 0
        return sum(1 for a in state["waiting"] if a != self.agent_id and a not in members)

    def next_rendezvous(self) -> RendezvousInfo:
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        master_addr = self.master_addr()
        agent = self._register()
        after = self._state()["round"]["round"]
        waiting_key = self._k(f"waiting/{self.agent_id}")
        self._client.put(waiting_key, json.dumps({"after": after}).encode(), lease=agent.lease_id)
        deadline = time.monotonic() + self._join_timeout
        seen: tuple[str, ...] = ()
        changed_at = time.monotonic()
        log.info("agent %s waits for a round after %d", self.agent_id, after)
        while True:
            self._wake.clear()
            state = self._state()
            doc = state["round"]
            if doc["round"] > after and self.agent_id in doc["members"]:
                break
            if state["closed"]:
                # Only a finished job closes the rendezvous (shutdown): a standby, or an
                # agent waiting to rejoin, has nothing left to do. torch's own way to say so,
                # RendezvousGracefulExitError, makes torch 2.13's launcher fail on it
                # ('NoneType' object has no attribute 'is_failed', exit 1); SystemExit(0)
                # goes through the agent's and the launcher's cleanup and exits 0.
                self._client.delete(waiting_key)
                log.warning("agent %s: the job %r finished while this agent waited for a "
                            "round; exiting", self.agent_id, self._run_id)
                raise SystemExit(0)
            if agent.lost.is_set():  # cut off longer than the lease: register again
                agent = self._register()
                self._client.put(waiting_key, json.dumps({"after": after}).encode(),
                                 lease=agent.lease_id)
                continue
            agents = state["agents"]
            waiting = sorted((a for a in state["waiting"] if a in agents),
                             key=lambda a: agents[a].create_revision)
            now = time.monotonic()
            if tuple(waiting) != seen:
                seen, changed_at = tuple(waiting), now
            if waiting and waiting[0] == self.agent_id:
                self._maybe_form(state, waiting, now - changed_at)
            if now > deadline:
                self._client.delete(waiting_key)
                raise RendezvousTimeoutError(
                    f"no rendezvous round of {self._min}..{self._max} agents in "
                    f"{self._join_timeout:.0f} s (run {self._run_id!r})")
            self._wake.wait(_POLL_S)
        members = doc["members"]
        self._round = doc["round"]
        rank, world = members.index(self.agent_id), len(members)
        log.info("agent %s: round %d, rank %d of %d", self.agent_id, self._round, rank, world)
        self._store = EtcdV3Store(self._client, self._k(f"store/{self._round}/"),
                                  self._job_lease_id, self._store_timeout)
        bootstrap = RendezvousStoreInfo.build(rank, self._store, master_addr)
        return RendezvousInfo(self._store, rank, world, bootstrap)

    def _maybe_form(self, state: dict[str, Any], waiting: list[str], quiet_s: float) -> None:
        """As the oldest waiting agent: write the next round if it is time.

        A member of the current round whose agent key is there but who does not wait is
        still training in that round. While no member of the round waits, the round is
        intact: a round formed beside it would be a second job (standbys beyond MAX, or
        newcomers, starting a group of their own), so none is. Once one member is back (its
        workers failed, or it restarts them for newcomers: ``num_nodes_waiting``), the others
        get ``last_call_timeout`` of quiet to come back too; one that has not by then is
        left out (it died and its lease has not expired yet, or it hangs). A member that
        exits deletes its key at once (SIGTERM included)."""
        n, current = len(waiting), state["round"]["round"]
        if n < self._min:
            return
        in_round = state["round"]["members"]
        out = [m for m in in_round if m in state["agents"] and m not in waiting]
        if out:
            broken = any(m in waiting for m in in_round)
            if not (broken and quiet_s >= self._last_call):
                return
        every_live_agent = set(state["agents"]) <= set(waiting)
        if not (n >= self._max or quiet_s >= self._last_call
                or (current > 0 and every_live_agent and quiet_s >= self._settle)):
            return
        members = waiting[: self._max]
        if out:
            log.info("round %d: leaving out %s (not back after %.1f s)", current + 1, out,
                     quiet_s)
        doc = json.dumps({"round": current + 1, "members": members}).encode()
        rnd: KeyValue | None = state["round_kv"]
        guard = (Txn.version(self._k("round")) == 0 if rnd is None
                 else Txn.mod(self._k("round")) == rnd.mod_revision)
        ops = [Txn.delete(self._k(f"waiting/{m}")) for m in members]
        if current >= 1:  # the store two rounds back: nobody reads it any more
            ops.append(Txn.delete(self._k(f"store/{current - 1}/"), prefix=True))

        def write(lease: int | None) -> bool:
            ok, _ = self._client.txn([guard], [Txn.put(self._k("round"), doc, lease), *ops])
            return ok

        if self._with_job_lease(write):
            log.info("round %d: %s", current + 1, members)

    def _leave(self) -> None:
        """Take this agent out: its keys go now, not a lease TTL later."""
        if self._shut:
            return
        self._shut = True
        try:
            if self._watch is not None:
                self._watch.stop()
            if self._agent is not None:
                self._agent.close(revoke=True)
            job_lease = self._job_lease
            if job_lease is not None:
                self._keeper.forget(job_lease)
            self._keeper.stop()
            self._client.close()
        except Exception as exc:  # at exit: never mask the agent's own outcome
            log.warning("leaving rendezvous %s: %s", self._run_id, exc)

    def shutdown(self) -> bool:
        """At agent exit. When the job finished (torch's exit barrier passed in this round),
        close the rendezvous so standby agents stop waiting; otherwise only leave: an agent
        that gives up does not end the job for the others (c10d closes it)."""
        try:
            if self._store is not None and self._store.check([_EXIT_BARRIER_DONE]):
                self.set_closed()
        except Exception as exc:
            log.warning("closing rendezvous %s: %s", self._run_id, exc)
        self._leave()
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return PeerElasticRendezvousHandler(params)
