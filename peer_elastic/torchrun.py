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

    P lease              the job lease id, decimal (attached to itself; every agent keeps it alive)
    P agents/<agent>     one per live agent (agent lease): its age is its create revision
    P waiting/<agent>    an agent inside next_rendezvous(): {"after": n} (agent lease)
    P left/<agent>       an agent that left gracefully, its workers stopped (job lease)
    P round              {"round": n, "members": [...]}, oldest agent first (job lease; CAS)
    P store/<n>/<key>    the torch Store of round n (job lease; peer_elastic.torch.store)
    P closed             set_closed() (job lease)

Every value read is parsed strictly (:func:`parse_round`, :func:`parse_waiting`,
:func:`parse_lease_id`); a malformed one is logged once and treated as absent (a malformed
``round`` is overwritten by the next round's compare-and-swap). Nothing is unpickled.

The oldest *waiting* agent (smallest create revision of its ``agents/`` key) writes the next
round when at least ``min_nodes`` wait and either ``max_nodes`` wait, every live agent waits
(after ``settle``), or the set of waiting agents has been unchanged for ``last_call_timeout``;
but never while a member of the current round may still train in it and no member is back:
standbys and newcomers do not start a group beside a running one. A member may still train
while its agent key is there, and also for :meth:`PeerElasticRendezvousHandler.silence_hold_s`
(``etcd_outage_s + lease_ttl``) after an agent first saw its key gone without a ``left/``
marker: an agent cut off from etcd keeps its workers training for up to ``etcd_outage_s``
(:func:`possibly_training`). Once one member is back (its workers failed, or it restarts them
for newcomers), the round's group is broken, and a member not back ``last_call_timeout``
later is left out. Ranks follow age, so the oldest agent is group rank 0. Round numbers never
go backwards: the next round is one more than the highest any waiting agent saw, so agents
whose job lease expired (all keys gone) recognise the new round at once.

Outages: the agent's monitor loop calls ``num_nodes_waiting()`` every ``--monitor-interval``;
while etcd does not answer it gives its last answer (logged once), so an outage shorter than
``etcd_outage_s`` costs nothing. Past it, or once this agent's own key is gone (its lease
expired while it was cut off), it answers 1, which makes torch stop the workers and
rendezvous again. Every other call retries until etcd has not answered for
``etcd_outage_s`` and then raises :class:`RendezvousConnectionError`.

Agents beyond ``max_nodes`` stand by: they wait in ``waiting/`` without disturbing the
running round (``num_nodes_waiting()`` is 0 at ``max_nodes``), take a place in the next round
when a member is lost (oldest first), and exit 0 when the job finishes (the rendezvous is
closed) or fail after ``join_timeout``.

Group rank 0 publishes MASTER_ADDR: torchrun's ``--local-addr`` if given, otherwise the
address :mod:`peer_elastic.process.netaddr` chooses, as for a peer (``PEER_ELASTIC_ADDR``,
``PEER_ELASTIC_IFNAME``, else the interface that routes to the etcd endpoints), whose
interface each agent also hands to its workers' gloo (``GLOO_SOCKET_IFNAME``).

``--rdzv-conf`` keys: ``lease_ttl`` (5 s), ``last_call_timeout`` (2 s), ``settle`` (0.3 s),
``join_timeout`` (600 s), ``run_ttl`` (60 s: how long the job's keys outlive its last agent),
``store_timeout`` (300 s), ``etcd_outage_s`` (60 s). TLS and auth come from the
``PEER_ELASTIC_ETCD_*`` variables, as for every peer; without ``--rdzv-endpoint``,
``PEER_ELASTIC_ETCD`` names the endpoints.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar


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


from torch.distributed.elastic.rendezvous import (  # noqa: E402 - after register (above)
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from peer_elastic.errors import EtcdError, EtcdUnavailable, LeaseNotFound  # noqa: E402
from peer_elastic.etcd.client import EtcdClient, KeyValue, Txn, client_from_env  # noqa: E402
from peer_elastic.etcd.lease import LeaseKeeper, Session  # noqa: E402
from peer_elastic.etcd.watch import PrefixWatch  # noqa: E402
from peer_elastic.process.netaddr import NetChoice, select_address  # noqa: E402
from peer_elastic.torch.store import EtcdStore  # noqa: E402

log = logging.getLogger(__name__)

BACKEND = "peer-elastic"
ROOT = "/peer-elastic-torchrun/"
# torch's exit barrier (torch/distributed/elastic/agent/server/api.py, utils/store.py): its
# last-member key in a round's store means the job finished there.
_EXIT_BARRIER_DONE = "torchelastic/agent/terminal_state/last_member"
_POLL_S = 0.2
# num_nodes_waiting() runs in torch's monitor loop: its reads give up this soon, so an etcd
# outage delays the loop by at most this much per call (it answers from its last value).
_MONITOR_READ_BUDGET_S = 1.0
_MAX_LEASE_ID = 2**63 - 1
# A round number read back: below this, so that the next round (one more) is valid too.
_MAX_ROUND = 2**62

T = TypeVar("T")


#: The run id torchrun uses when ``--rdzv-id`` is not given.
TORCHRUN_DEFAULT_RUN_ID = "none"


def run_prefix(run_id: str) -> str:
    return f"{ROOT}{urllib.parse.quote(run_id, safe='')}/"


# -- records: strict parsing of everything read from etcd ------------------------------------------


@dataclass(frozen=True)
class RoundRecord:
    """``P round``: round ``number`` (1, 2, ...) and its members, oldest agent (rank 0) first."""

    number: int
    members: tuple[str, ...]

    def encode(self) -> bytes:
        return json.dumps({"round": self.number, "members": list(self.members)}).encode()


NO_ROUND = RoundRecord(0, ())


def _strict_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json_object(value: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def parse_round(value: bytes) -> RoundRecord | None:
    """The round a ``round`` value holds, or None if it is not a valid one: a JSON object with
    ``round`` a positive integer and ``members`` a non-empty list of distinct non-empty
    strings. (A plain JSON parse of a torn or foreign value would raise inside the agent.)"""
    doc = _json_object(value)
    if doc is None:
        return None
    number, members = _strict_int(doc.get("round")), doc.get("members")
    if number is None or not 1 <= number <= _MAX_ROUND + 1 or not isinstance(members, list):
        return None
    if not members or not all(isinstance(m, str) and m for m in members) \
            or len(set(members)) != len(members):
        return None
    return RoundRecord(number, tuple(members))


def parse_waiting(value: bytes) -> int | None:
    """The round a ``waiting/`` key says its agent saw last (``{"after": n}``), or None."""
    doc = _json_object(value)
    after = _strict_int(doc.get("after")) if doc is not None else None
    return after if after is not None and 0 <= after <= _MAX_ROUND else None


def parse_lease_id(value: bytes) -> int | None:
    """The job lease id of a ``lease`` value (positive decimal ASCII), or None."""
    text = value.decode("ascii", "replace")
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        return None
    lease_id = int(text)
    return lease_id if 0 < lease_id <= _MAX_LEASE_ID else None


class _MalformedLog:
    """Logs each malformed value once (per key and revision), not once per poll."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def note(self, kv: KeyValue, what: str) -> None:
        mark = (kv.key, kv.mod_revision)
        if mark in self._seen:
            return
        self._seen.add(mark)
        log.warning("ignoring a malformed %s in etcd at %s (revision %d): %r; treated as "
                    "absent", what, kv.key, kv.mod_revision, kv.value[:80])


@dataclass
class RendezvousState:
    """One consistent read of the rendezvous' keys, every value validated."""

    agents: dict[str, KeyValue] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)  # agent -> the round it saw last
    left: set[str] = field(default_factory=set)
    round_kv: KeyValue | None = None  # the raw key, also when malformed: the CAS guards on it
    round: RoundRecord = NO_ROUND
    closed: bool = False


def possibly_training(member: str, state: RendezvousState, missing_since: Mapping[str, float],
                      hold_s: float, now: float) -> bool:
    """Whether a member of the current round may still have workers training in it.

    Yes while its agent key is there and it does not wait. Yes also while its key is gone
    without a ``left/`` marker (it did not leave: its lease expired) until ``hold_s`` after
    this agent first saw it gone: an agent cut off from etcd keeps its workers training until
    it has not reached etcd for ``etcd_outage_s``, and its last contact was before its lease
    expired, which was before anyone saw its key gone. (``missing_since`` is this agent's own
    observation, never earlier than its own start: a late observer only waits longer.)
    """
    if member in state.waiting or member in state.left:
        return False
    if member in state.agents:
        return True
    since = missing_since.get(member)
    return since is None or now - since < hold_s


def next_round_number(state: RendezvousState, highest_seen: int) -> int:
    """One more than the highest round any live waiting agent (or this one) saw: never
    backwards, also after the job lease expired and took ``round`` with it. (A ``waiting/``
    key without its agent's key is a leftover, not an agent: it does not count.)"""
    seen = [after for agent, after in state.waiting.items() if agent in state.agents]
    return min(max(state.round.number, highest_seen, *seen, 0), _MAX_ROUND) + 1


class RendezvousReader:
    """Reads the rendezvous' keys (:class:`RendezvousState`, every value validated) and
    remembers across reads what this agent saw: the highest round number (rounds never go
    backwards), the newest valid round (for when ``round`` vanishes with an expired job
    lease), and when each member of it was first seen without its key."""

    def __init__(self, prefix: str, malformed: _MalformedLog) -> None:
        self._prefix = prefix
        self._malformed = malformed
        self.highest_round = 0
        self.last_round = NO_ROUND
        self.missing_since: dict[str, float] = {}  # round member -> first seen without key

    def read(self, client: EtcdClient) -> RendezvousState:
        kvs, _ = client.get_prefix(self._prefix)
        state = RendezvousState()
        for kv in kvs:
            name = kv.key[len(self._prefix):]
            if name.startswith("agents/"):
                state.agents[name[len("agents/"):]] = kv
            elif name.startswith("waiting/"):
                after = parse_waiting(kv.value)
                if after is None:
                    self._malformed.note(kv, "waiting record")
                    after = 0
                state.waiting[name[len("waiting/"):]] = after
            elif name.startswith("left/"):
                state.left.add(name[len("left/"):])
            elif name == "round":
                state.round_kv = kv
                record = parse_round(kv.value)
                if record is None:
                    self._malformed.note(kv, "round record")
                else:
                    state.round = record
            elif name == "closed":
                state.closed = True
        if state.round.number > self.highest_round:
            self.highest_round = state.round.number
        if state.round.number >= self.last_round.number and state.round is not NO_ROUND:
            self.last_round = state.round
        return state

    def latest_round(self, state: RendezvousState) -> RoundRecord:
        """``state``'s round, or the newest this agent saw when ``round`` is gone."""
        return state.round if state.round is not NO_ROUND else self.last_round

    def note_missing(self, state: RendezvousState, now: float) -> None:
        """When this agent first saw each member of the latest round without its key."""
        members = self.latest_round(state).members
        for m in members:
            if m in state.agents:
                self.missing_since.pop(m, None)
            else:
                self.missing_since.setdefault(m, now)
        for m in [m for m in self.missing_since if m not in members]:
            del self.missing_since[m]


class JobLease:
    """The job lease (``P lease``): created by the first agent, adopted and kept alive by
    every agent, so the job's keys outlive its last agent by ``ttl_s``."""

    def __init__(self, client: EtcdClient, prefix: str, ttl_s: float, keeper: LeaseKeeper,
                 malformed: _MalformedLog) -> None:
        self._client = client
        self._prefix = prefix
        self._key = prefix + "lease"
        self._ttl_s = ttl_s
        self._keeper = keeper
        self._malformed = malformed
        self._lock = threading.Lock()
        self._id: int | None = None

    @property
    def known(self) -> int | None:
        """The lease id this agent keeps alive now, if any (no etcd request)."""
        return self._id

    def id(self) -> int:
        """The job lease's id: adopted from ``P lease``, or a fresh one put there."""
        with self._lock:
            if self._id is not None:
                return self._id
            for _ in range(10):
                kv = self._client.get(self._key)
                lease_id = parse_lease_id(kv.value) if kv is not None else None
                if kv is not None and lease_id is None:
                    self._malformed.note(kv, "job lease id")
                if lease_id is None:  # absent or malformed: put a fresh one in its place
                    lease_id = self._client.grant(self._ttl_s)
                    if not self._client.compare_and_put(
                            self._key, str(lease_id).encode(),
                            kv.mod_revision if kv is not None else 0, lease=lease_id):
                        self._client.revoke(lease_id)
                        continue
                self._keeper.keep(lease_id, self._ttl_s, self.lost,
                                  refresh_now=True)  # adopted: it may be near its end
                self._id = lease_id
                return lease_id
            raise EtcdError(f"could not agree on a job lease under {self._prefix}")

    def lost(self, lease_id: int, why: str) -> None:
        """The keeper's word that ``lease_id`` is gone: the next :meth:`id` finds another."""
        with self._lock:
            if self._id == lease_id:
                self._id = None

    def run(self, fn: Callable[[int], T]) -> T:
        """``fn(lease id)``; once more with a new job lease when etcd no longer knows it."""
        try:
            return fn(self.id())
        except LeaseNotFound:
            self.lost(self._id or 0, "lease not found")
            return fn(self.id())

    def forget(self) -> None:
        """Stop keeping it alive (this agent leaves)."""
        if self._id is not None:
            self._keeper.forget(self._id)


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
        self._etcd_outage = float(params.get("etcd_outage_s", 60.0))
        budget = max(1.0, min(15.0, self._etcd_outage))
        self._client = client or client_from_env(params.endpoint or None,
                                                 retry_budget_s=budget)
        # The monitor loop's reads (num_nodes_waiting) give up fast and answer from the last
        # value instead; a client of their own, so they never wait out the main budget.
        self._monitor_client = client or client_from_env(
            params.endpoint or None, retry_budget_s=_MONITOR_READ_BUDGET_S)
        self._prefix = run_prefix(self._run_id)
        if self._run_id == TORCHRUN_DEFAULT_RUN_ID:
            # torchrun's (and accelerate's) default when --rdzv-id is left out: every job on
            # this etcd that forgot it would share one rendezvous.
            log.warning("rendezvous id %r is torchrun's default: every job on this etcd that "
                        "leaves out --rdzv-id (or PET_RDZV_ID) joins this same rendezvous; "
                        "give each job its own id", self._run_id)
        host = socket.gethostname().split(".")[0] or "host"
        self.agent_id = f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
        self._keeper = LeaseKeeper(self._client, name="rdzv-lease-keeper")
        malformed = _MalformedLog()
        self._job_lease = JobLease(self._client, self._prefix, self._run_ttl, self._keeper,
                                   malformed)
        self._reader = RendezvousReader(self._prefix, malformed)
        self._agent: Session | None = None
        self._wake = threading.Event()
        self._watch: PrefixWatch | None = None
        self._round = 0
        self._store: EtcdStore | None = None
        self._net: NetChoice | None = None
        # num_nodes_waiting's memory across an outage.
        self._last_waiting = 0
        self._last_contact = time.monotonic()
        self._outage_logged = False
        self._shut = False
        atexit.register(self._leave)

    @property
    def silence_hold_s(self) -> float:
        """How long after a round member's key was first seen gone (without a graceful
        leave) it may still train: its agent stops the workers once it has not reached etcd
        for ``etcd_outage_s``; ``lease_ttl`` more covers the monitor interval and the
        workers' stop."""
        return self._etcd_outage + self._lease_ttl

    # -- etcd calls through an outage -------------------------------------------------------------

    def _retry(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, retried while etcd does not answer, until it has not answered for
        ``etcd_outage_s``; then a RendezvousConnectionError that says so."""
        started: float | None = None
        logged = False
        while True:
            try:
                return fn(*args)
            except EtcdUnavailable as exc:
                now = time.monotonic()
                if started is None:  # the failed call already spent the client's budget
                    started = now - self._client.retry_budget_s
                if now - started >= self._etcd_outage:
                    raise RendezvousConnectionError(
                        f"rendezvous {self._run_id!r}: etcd ({self._client.describe()}) did "
                        f"not answer for {now - started:.0f} s while this agent tried to "
                        f"{what} (the rdzv-conf etcd_outage_s is {self._etcd_outage:.0f} s); "
                        f"last error: {exc}") from exc
                if not logged:
                    log.warning("agent %s: etcd does not answer (%s); retrying for up to "
                                "%.0f s", self.agent_id, exc, self._etcd_outage)
                    logged = True
                time.sleep(0.5)

    # -- keys and leases ------------------------------------------------------------------------

    def _k(self, name: str) -> str:
        return self._prefix + name

    def _register(self, renew: bool = False) -> Session:
        """This agent's session and ``agents/`` key; a new one if the lease is lost or
        ``renew`` (etcd refused the lease: it expired before the keeper could tell)."""
        if self._agent is not None and not self._agent.lost.is_set() and not renew:
            return self._agent
        if self._agent is not None:
            self._agent.close(revoke=False)
        self._job_lease.id()
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

    def _wait_in(self, waiting_key: str, waiting_value: bytes) -> Session:
        """Register (if need be) and put this agent's ``waiting/`` key under its lease."""
        agent = self._register()
        try:
            self._client.put(waiting_key, waiting_value, lease=agent.lease_id)
        except LeaseNotFound:
            # The lease expired while this agent was cut off (or frozen) and its keeper has
            # not heard yet: register anew, as a new (youngest) agent.
            log.warning("agent %s: its lease expired; registering again", self.agent_id)
            agent = self._register(renew=True)
            self._client.put(waiting_key, waiting_value, lease=agent.lease_id)
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

    def _state(self, client: EtcdClient | None = None) -> RendezvousState:
        return self._reader.read(client or self._client)

    # -- RendezvousHandler ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._retry("read whether the rendezvous is closed",
                           lambda: self._client.get(self._k("closed")) is not None)

    def set_closed(self) -> None:
        self._retry("close the rendezvous", lambda: self._job_lease.run(
            lambda lease: self._client.put(self._k("closed"), b"1", lease=lease)))

    def num_nodes_waiting(self) -> int:
        """Agents waiting to join the running round (0 at ``max_nodes``): torch's monitor
        loop restarts the workers when positive. Never raises on an etcd outage: it answers
        its last answer until etcd has not answered for ``etcd_outage_s``, then 1, so that
        torch stops the workers (an agent cut off from etcd must not train on: others may
        replace its round). Also 1 once this agent's own key is gone (its lease expired):
        the others no longer count it, so it stops its workers and rendezvous again."""
        now = time.monotonic()
        try:
            state = self._state(self._monitor_client)
        except EtcdUnavailable as exc:
            silent_s = now - self._last_contact
            if silent_s >= self._etcd_outage:
                log.error("agent %s: etcd has not answered for %.0f s (etcd_outage_s %.0f s): "
                          "stopping the workers, since the other agents may replace this "
                          "round; last error: %s", self.agent_id, silent_s,
                          self._etcd_outage, exc)
                return 1
            if not self._outage_logged:
                self._outage_logged = True
                log.warning("agent %s: etcd does not answer (%s); the workers train on, for "
                            "up to %.0f s without etcd", self.agent_id, exc, self._etcd_outage)
            return self._last_waiting
        self._last_contact = now
        if self._outage_logged:
            self._outage_logged = False
            log.warning("agent %s: etcd answers again", self.agent_id)
        if self._round and self.agent_id not in state.agents:
            log.warning("agent %s: its key is gone (its lease expired while it was cut off "
                        "from etcd): stopping the workers of round %d to rendezvous again",
                        self.agent_id, self._round)
            return 1
        members = self._reader.latest_round(state).members
        if len(members) >= self._max:
            answer = 0
        else:
            answer = sum(1 for a in state.waiting
                         if a != self.agent_id and a not in members and a in state.agents)
        self._last_waiting = answer
        return answer

    def next_rendezvous(self) -> RendezvousInfo:
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        master_addr = self.master_addr()
        first = self._retry("read the rendezvous", self._state)
        after = max(first.round.number, self._reader.highest_round)
        waiting_key = self._k(f"waiting/{self.agent_id}")
        waiting_value = json.dumps({"after": after}).encode()
        agent = self._retry("wait for a round", self._wait_in, waiting_key, waiting_value)
        deadline = time.monotonic() + self._join_timeout
        seen: tuple[str, ...] = ()
        changed_at = time.monotonic()
        log.info("agent %s waits for a round after %d", self.agent_id, after)
        while True:
            self._wake.clear()
            state = self._retry("read the rendezvous", self._state)
            now = time.monotonic()
            self._reader.note_missing(state, now)
            record = state.round
            if record.number > after and self.agent_id in record.members:
                break
            if state.closed:
                # Only a finished job closes the rendezvous (shutdown): a standby, or an
                # agent waiting to rejoin, has nothing left to do. torch's own way to say so,
                # RendezvousGracefulExitError, makes torch 2.13's launcher fail on it
                # ('NoneType' object has no attribute 'is_failed', exit 1); SystemExit(0)
                # goes through the agent's and the launcher's cleanup and exits 0.
                self._retry("leave the rendezvous", self._client.delete, waiting_key)
                log.warning("agent %s: the job %r finished while this agent waited for a "
                            "round; exiting", self.agent_id, self._run_id)
                raise SystemExit(0)
            if agent.lost.is_set() or self.agent_id not in state.waiting:
                # Cut off longer than the lease (or the waiting key went with it): register
                # again; the lease keeper says so only when etcd confirms the lease is gone.
                agent = self._retry("wait for a round", self._wait_in, waiting_key,
                                    waiting_value)
                continue
            agents = state.agents
            waiting = sorted((a for a in state.waiting if a in agents),
                             key=lambda a: agents[a].create_revision)
            if tuple(waiting) != seen:
                seen, changed_at = tuple(waiting), now
            if waiting and waiting[0] == self.agent_id:
                self._retry("write the next round", self._maybe_form, state, waiting,
                            now - changed_at, now)
            if now > deadline:
                self._retry("leave the rendezvous", self._client.delete, waiting_key)
                raise RendezvousTimeoutError(
                    f"no rendezvous round of {self._min}..{self._max} agents in "
                    f"{self._join_timeout:.0f} s (run {self._run_id!r})")
            self._wake.wait(_POLL_S)
        members = record.members
        self._round = record.number
        rank, world = members.index(self.agent_id), len(members)
        log.info("agent %s: round %d, rank %d of %d", self.agent_id, self._round, rank, world)
        if self._store is not None:
            self._store.close()  # the previous round's: torch no longer uses it
        lease = self._retry("read the job lease", self._job_lease.id)
        self._store = EtcdStore(self._client, self._k(f"store/{self._round}/"), lease,
                                datetime.timedelta(seconds=self._store_timeout))
        bootstrap = RendezvousStoreInfo.build(rank, self._store, master_addr)
        return RendezvousInfo(self._store, rank, world, bootstrap)

    def _maybe_form(self, state: RendezvousState, waiting: list[str], quiet_s: float,
                    now: float) -> None:
        """As the oldest waiting agent: write the next round if it is time.

        While a member of the current round may still train in it (:func:`possibly_training`)
        and no member is back, the round is intact: a round formed beside it would be a
        second job (standbys beyond MAX, or newcomers, starting a group of their own), so
        none is. Once one member is back (its workers failed, or it restarts them for
        newcomers: ``num_nodes_waiting``), its group is broken, and the others get
        ``last_call_timeout`` of quiet to come back too; one that has not by then is left
        out (it died and its lease has not expired yet, or it hangs, or it is cut off and
        its workers, without that member, cannot go on). A member that exits deletes its
        key at once (SIGTERM included) and says it left."""
        n = len(waiting)
        if n < self._min:
            return
        current = self._reader.latest_round(state)
        in_round = current.members
        out = [m for m in in_round if possibly_training(m, state, self._reader.missing_since,
                                                        self.silence_hold_s, now)]
        broken = any(m in state.waiting for m in in_round)
        if out and not broken:
            return
        # A member with its key may still come back: it gets the last call. One whose key
        # is gone cannot come back into this round, and without the member that is back
        # its workers cannot go on: it is not waited for (as before its key went).
        if any(m in state.agents for m in out) and quiet_s < self._last_call:
            return
        every_live_agent = set(state.agents) <= set(waiting)
        if not (n >= self._max or quiet_s >= self._last_call
                or (current.number > 0 and every_live_agent and quiet_s >= self._settle)):
            return
        members = tuple(waiting[: self._max])
        number = next_round_number(state, self._reader.highest_round)
        if out:
            log.info("round %d: leaving out %s (not back after %.1f s)", number, out, quiet_s)
        record = RoundRecord(number, members)
        rnd = state.round_kv
        guard = (Txn.version(self._k("round")) == 0 if rnd is None
                 else Txn.mod(self._k("round")) == rnd.mod_revision)
        ops = [Txn.delete(self._k(f"waiting/{m}")) for m in members]
        if number >= 3:  # the store two rounds back: nobody reads it any more
            ops.append(Txn.delete(self._k(f"store/{number - 2}/"), prefix=True))

        def write(lease: int) -> bool:
            ok, _ = self._client.txn([guard], [Txn.put(self._k("round"), record.encode(), lease),
                                               *ops])
            return ok

        if self._job_lease.run(write):
            log.info("round %d: %s", number, list(members))

    def _leave(self) -> None:
        """Take this agent out: its keys go now, not a lease TTL later, and a ``left/``
        marker says it left (its workers are stopped), so no agent waits for it to stop."""
        if self._shut:
            return
        self._shut = True
        agent, store = self._agent, self._store
        steps: list[tuple[str, Callable[[], object]]] = []
        if self._watch is not None:
            steps.append(("stop the watch", self._watch.stop))
        if agent is not None:
            steps += [("say it left", self._say_left),
                      ("revoke its lease", lambda: agent.close(revoke=True))]
        steps.append(("stop keeping the job lease", self._job_lease.forget))
        steps.append(("stop the lease keeper", self._keeper.stop))
        if store is not None:
            steps.append(("close the store", store.close))
        for client in {id(c): c for c in (self._client, self._monitor_client)}.values():
            steps.append(("close an etcd client", client.close))
        for what, step in steps:  # each on its own: one failure must not skip the rest
            try:
                step()
            except Exception as exc:  # at exit: never mask the agent's own outcome
                log.warning("leaving rendezvous %s: %s: %s", self._run_id, what, exc)

    def _say_left(self) -> None:
        lease = self._job_lease.known
        if lease is None:
            return
        self._client.txn([], [Txn.put(self._k(f"left/{self.agent_id}"), b"", lease),
                              Txn.delete(self._k(f"agents/{self.agent_id}")),
                              Txn.delete(self._k(f"waiting/{self.agent_id}"))])

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
