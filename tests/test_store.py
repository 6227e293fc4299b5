"""EtcdStore against a real etcd: the Store API, and real gloo process groups over it.

The unit tests drive the store directly and through ``torch.distributed.PrefixStore``
(C++), which calls back into Python the way gloo's rendezvous does, so the trampoline
names (``deleteKey``, ``getNumKeys``, ...) are exercised too.

The multi-process tests reuse three worker processes for the whole module, because
importing torch costs seconds on a small box. A worker is this file run as a script: it
reads one JSON command per line on stdin and answers one JSON line on stdout.

``PEER_ELASTIC_BENCH=1`` enables a benchmark of ``init_process_group`` over EtcdStore
versus TCPStore (run it with ``-s`` to see the table).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.keys import RunKeys
from peer_elastic.etcd_server import free_port
from peer_elastic.torch.store import EtcdStore, StoreAborted, StoreTimeout

BENCH_ENV = "PEER_ELASTIC_BENCH"


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def prefix(unique_job: str) -> str:
    return RunKeys(unique_job, "run0").store_prefix(1)


@pytest.fixture
def store(client: EtcdClient, prefix: str) -> EtcdStore:
    return EtcdStore(client, prefix, timeout=timedelta(seconds=5))


def later(delay_s: float, fn: Callable[[], object]) -> threading.Timer:
    t = threading.Timer(delay_s, fn)
    t.daemon = True
    t.start()
    return t


def open_watches(client: EtcdClient) -> int:
    """Watches the client still has registered (reaches into etcd3: test-only)."""
    watcher = client._raw._stubs.get("watcher")
    return 0 if watcher is None else len(watcher._callbacks)


# --- unit tests -----------------------------------------------------------------------------


def test_set_get_raw_bytes_and_overwrite(store: EtcdStore, client: EtcdClient,
                                         prefix: str) -> None:
    blob = bytes(range(256)) * 4
    store.set("a/b", blob)  # torch keys may contain '/'
    assert store.get("a/b") == blob
    assert client.get(prefix + "a/b").value == blob
    store.set("a/b", "text")  # Python callers may pass str, as with torch's stores
    assert store.get("a/b") == b"text"


def test_on_value_sees_each_write_after_etcd_holds_it_and_each_read(
        client: EtcdClient, prefix: str) -> None:
    seen: list[tuple[str, bytes, bytes | None]] = []
    with EtcdStore(client, prefix, on_value=lambda k, v: seen.append(
            (k, v, client.get(prefix + k).value))) as store:
        store.set("0/1", b"\x00rank record")
        store.set("x", "text")
        assert seen == [("0/1", b"\x00rank record", b"\x00rank record"),
                        ("x", b"text", b"text")]
        seen.clear()
        store.multi_set(["m1", "m2"], [b"1", "2"])
        assert store.get("0/1") == b"\x00rank record"
        assert store.multi_get(["m2", "x"]) == [b"2", b"text"]
        clone = store.clone()  # torch clones the store for some subgroups: the hook goes along
        try:
            assert clone.get("m1") == b"1"
        finally:
            clone.close()
    assert [(k, v) for k, v, _ in seen] == [
        ("m1", b"1"), ("m2", b"2"), ("0/1", b"\x00rank record"), ("m2", b"2"), ("x", b"text"),
        ("m1", b"1")]


def test_get_blocks_until_set_then_times_out(store: EtcdStore) -> None:
    later(0.3, lambda: store.set("late", b"v"))
    t0 = time.monotonic()
    assert store.get("late") == b"v"
    assert 0.25 < time.monotonic() - t0 < 2.0

    store.set_timeout(timedelta(seconds=0.4))
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="never") as info:
        store.get("never")
    assert isinstance(info.value, dist.DistStoreError)  # what torch's own stores raise
    assert 0.35 < time.monotonic() - t0 < 1.5


def test_wait_many_keys_with_timeout_override(store: EtcdStore, client: EtcdClient) -> None:
    store.wait([])
    store.set("k0", b"x")
    later(0.2, lambda: store.set("k1", b"x"))
    later(0.4, lambda: store.set("other/k2", b"x"))
    t0 = time.monotonic()
    store.wait(["k0", "k1", "other/k2"], timedelta(seconds=5))
    assert 0.35 < time.monotonic() - t0 < 2.0

    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="missing"):
        store.wait(["k0", "missing"], timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 1.0
    assert open_watches(client) == 0


def test_wait_ignores_longer_keys_and_deleted_keys(store: EtcdStore) -> None:
    store.set("rank/10", b"x")  # shares the prefix "rank/1"
    with pytest.raises(StoreTimeout):
        store.wait(["rank/1"], timedelta(seconds=0.3))
    timers = [later(0.1, lambda: (store.set("rank/1", b"x"), store.delete_key("rank/1"))),
              later(0.2, lambda: store.set("rank/11", b"x"))]
    with pytest.raises(StoreTimeout):
        store.wait(["rank/1", "rank/11"], timedelta(seconds=0.6))  # never both present
    for t in timers:  # on a loaded machine they may still be running: not past the client
        t.join(timeout=30)


def test_add_is_atomic(store: EtcdStore, etcd: str) -> None:
    assert store.add("n", 0) == 0  # like TCPStore: creates the counter
    assert store.get("n") == b"0"
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.get("n") == b"3"  # decimal ASCII, as torch's stores keep counters

    clients = [EtcdClient(etcd) for _ in range(4)]
    try:
        stores = [EtcdStore(c, store.prefix) for c in clients]
        results: list[int] = []
        lock = threading.Lock()

        def bump(s: EtcdStore) -> None:
            for _ in range(15):
                v = s.add("c", 1)
                with lock:
                    results.append(v)

        threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(results) == list(range(1, 61))  # every increment seen exactly once
        assert store.add("c", 0) == 60
    finally:
        for c in clients:
            c.close()

    store.set("bad", b"xyz")
    with pytest.raises(dist.DistStoreError, match="decimal"):
        store.add("bad", 1)


def test_compare_set_matches_hashstore(store: EtcdStore) -> None:
    ref = dist.HashStore()
    script = [
        ("k", b"x", b"y"),  # missing key, non-empty expectation: returns the expectation
        ("k", b"", b"y"),  # missing key, empty expectation: sets
        ("k", b"z", b"w"),  # mismatch: returns current
        ("k", b"y", b"w"),  # match: sets
        ("e", b"", b""),  # create an empty value
        ("e", b"", b"q"),  # existing empty value matches an empty expectation
        ("e", b"q", b"\x00\xff"),
    ]
    for key, expected, desired in script:
        want = ref.compare_set(key, expected, desired)
        assert store.compare_set(key, expected, desired) == want, (key, expected, desired)
        assert store.check([key]) == ref.check([key])
        if ref.check([key]):
            assert store.get(key) == ref.get(key)


def test_check_delete_num_keys_via_cpp_prefix_store(store: EtcdStore, prefix: str) -> None:
    p = dist.PrefixStore("pg", store)  # C++ calls back with trampoline names
    assert p.num_keys() == 0 and store.num_keys() == 0
    p.set("a", b"1")
    p.set("b", b"2")
    assert p.check(["a", "b"]) and not p.check(["a", "c"]) and p.check([])
    assert p.num_keys() == 2 and store.getNumKeys() == 2
    assert p.delete_key("a") is True
    assert p.delete_key("a") is False
    assert store.deleteKey("pg/b") is True
    assert store.num_keys() == 0
    assert p.add("cnt", 2) == 2 and p.get("cnt") == b"2"
    later(0.2, lambda: p.set("w", b"x"))
    p.wait(["w"])
    p.wait(["w"], timedelta(seconds=1))
    assert p.compare_set("cs", "", "v") == b"v"


def test_extended_api_and_clone(store: EtcdStore) -> None:
    p = dist.PrefixStore("pg", store)
    assert p.has_extended_api()
    p.multi_set(["m1", "m2"], [b"a", "b"])
    assert p.multi_get(["m2", "m1"]) == [b"b", b"a"]
    later(0.2, lambda: p.set("m3", b"c"))
    assert p.multi_get(["m1", "m3"]) == [b"a", b"c"]  # blocks like get
    p.append("log", b"x")
    p.append("log", "yz")
    assert p.get("log") == b"xyz"
    twin = p.clone()
    gc.collect()
    assert twin.get("m1") == b"a"
    assert store.clone().timeout == store.timeout


def test_store_outlives_callers_reference_until_close(client: EtcdClient, prefix: str) -> None:
    """torch keeps only the C++ half alive; the store must keep its Python half."""

    def wrapped() -> tuple[dist.PrefixStore, weakref.ref[EtcdStore]]:
        s = EtcdStore(client, prefix)
        return dist.PrefixStore("pg", s), weakref.ref(s)

    p, ref = wrapped()
    gc.collect()
    p.set("a", b"1")  # would be "INTERNAL ASSERT FAILED ... Not implemented" without it
    assert p.get("a") == b"1"
    store = ref()
    assert store is not None
    store.close()
    store.close()  # idempotent
    del store
    gc.collect()
    assert ref() is None


def test_abort_ends_wait_promptly(client: EtcdClient, prefix: str) -> None:
    reason: list[str | None] = [None]
    s = EtcdStore(client, prefix, timeout=timedelta(seconds=30), abort=lambda: reason[0])
    later(0.5, lambda: reason.__setitem__(0, "generation 1 was superseded by 2"))
    t0 = time.monotonic()
    with pytest.raises(StoreAborted, match="superseded by 2") as info:
        dist.PrefixStore("x", s).get("never")  # through C++, as in a rendezvous
    elapsed = time.monotonic() - t0
    assert 0.45 < elapsed < 0.5 + 0.6, elapsed  # poll interval 0.1 s, plus slack for load
    assert isinstance(info.value, dist.DistStoreError)
    assert s.abort_reason == "generation 1 was superseded by 2"
    # Once the reason stands, waits give up at once, even for keys that exist.
    s.set("there", b"x")
    with pytest.raises(StoreAborted):
        s.wait(["there"])
    assert open_watches(client) == 0


def test_zero_timeout_waits_until_abort(client: EtcdClient, prefix: str) -> None:
    stop: list[str | None] = [None]
    s = EtcdStore(client, prefix, timeout=timedelta(0), abort=lambda: stop[0])
    later(0.4, lambda: stop.__setitem__(0, "enough"))
    with pytest.raises(StoreAborted):
        s.wait(["never"])  # zero means no timeout, as in torch's stores


def test_keys_live_on_the_lease(client: EtcdClient, prefix: str) -> None:
    lease = client.grant(30)
    s = EtcdStore(client, prefix, lease_id=lease)
    s.set("a", b"x")
    s.add("n", 1)
    s.compare_set("c", "", "v")
    s.multi_set(["m"], [b"v"])
    s.append("l", b"v")
    kvs, _ = client.get_prefix(prefix)
    # Every key on the lease, add/append's exactly-once marker included (not counted).
    assert s.num_keys() == 5 and all(kv.lease == lease for kv in kvs)
    client.revoke(lease)
    assert s.num_keys() == 0


def test_wait_survives_etcd_restart(fresh_etcd: Any, unique_job: str,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """A watch lost with the server is replaced; the wait still sees the key."""
    caplog.set_level(logging.INFO, logger="peer_elastic.torch.store")
    c = EtcdClient(fresh_etcd.endpoint, retry_budget_s=20)
    try:
        s = EtcdStore(c, RunKeys(unique_job, "r").store_prefix(1), timeout=timedelta(seconds=20))
        writer = EtcdClient(fresh_etcd.endpoint, retry_budget_s=20)

        def bounce() -> None:
            fresh_etcd.kill()
            fresh_etcd.start(20)
            EtcdStore(writer, s.prefix).set("k", b"after restart")

        later(0.3, bounce)
        assert s.get("k") == b"after restart"
        assert "reading again" in caplog.text  # the watch really was lost and replaced
        writer.close()
    finally:
        c.close()


def test_wait_with_etcd_down_ends_in_store_timeout(fresh_etcd: Any, unique_job: str) -> None:
    """While etcd is down a wait is bounded by its own timeout and raises the torch type."""
    c = EtcdClient(fresh_etcd.endpoint, retry_budget_s=0.5, timeout_s=0.5)
    try:
        s = EtcdStore(c, RunKeys(unique_job, "r").store_prefix(1), timeout=timedelta(seconds=1.5))
        later(0.3, fresh_etcd.kill)
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match="last etcd error"):
            s.wait(["never"])
        assert time.monotonic() - t0 < 1.5 + 1.5
    finally:
        c.close()


# --- worker processes -----------------------------------------------------------------------

WORKER_START_S = 60.0


class Worker:
    """One long-lived worker process (this file run as a script)."""

    def __init__(self, endpoint: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="store-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), endpoint],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            bufsize=1,
        )
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"worker gave no answer in {timeout_s} s; {self.tail()}") from None
        if line is None:
            raise AssertionError(f"worker exited ({self.proc.poll()}); {self.tail()}")
        return json.loads(line)

    def tail(self) -> str:
        return "log: " + Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        os.unlink(self.log.name)


def start_workers(endpoint: str, n: int) -> list[Worker]:
    workers: list[Worker] = []
    try:
        for _ in range(n):
            workers.append(Worker(endpoint))
        for w in workers:
            assert w.reply(WORKER_START_S) == {"ready": True}
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


@pytest.fixture(scope="module")
def workers(_session_etcd_endpoint: str) -> Iterator[list[Worker]]:
    ws = start_workers(_session_etcd_endpoint, 3)
    try:
        yield ws
    finally:
        for w in ws:
            w.close()


def run_group(members: list[Worker], reply_s: float = 45.0, **cmd: Any) -> list[dict[str, Any]]:
    """Have ``members`` (rank = position) form one group with ``cmd``; their replies."""
    for rank, w in enumerate(members):
        w.send(op="group", rank=rank, world=len(members), **cmd)
    return [w.reply(reply_s) for w in members]


@pytest.mark.slow
def test_gloo_groups_over_etcd_store_two_generations(workers: list[Worker],
                                                     unique_job: str) -> None:
    keys = RunKeys(unique_job, "run0")
    # Generation 1: all three.
    out = run_group(workers, prefix=keys.store_prefix(1), new_group=True)
    for r in out:
        assert r["ok"], r
        assert r["sum"] == 1 + 2 + 3 and r["sub_sum"] == 1 + 2 + 3
    # Generation 2, same processes, a new prefix: worker 1 has left.
    out = run_group([workers[0], workers[2]], prefix=keys.store_prefix(2))
    for r in out:
        assert r["ok"], r
        assert r["sum"] == 1 + 2


@pytest.mark.slow
def test_init_abandoned_when_abort_gives_a_reason(workers: list[Worker],
                                                  unique_job: str) -> None:
    keys = RunKeys(unique_job, "run0")
    # Rank 0 of 2 waits for a peer that never comes; after 1 s abort() gives a reason.
    workers[0].send(op="group", rank=0, world=2, prefix=keys.store_prefix(1), abort_after=1.0)
    r = workers[0].reply(20)
    assert not r["ok"]
    assert "peer gone" in r["message"], r
    assert r["abort_reason"] == "peer gone"
    assert r["type"] == "StoreAborted", r  # our type survives the trip through gloo's C++
    assert r["is_dist_error"], r  # torch-typed, so callers treating DistError as "group broke" do
    assert 1.0 <= r["elapsed"] < 1.0 + 1.0, r
    # The failed rendezvous leaves the process able to form the next group.
    out = run_group(workers[:2], prefix=keys.store_prefix(2), timeout_s=10)
    assert all(r["ok"] and r["sum"] == 3 for r in out), out


@pytest.mark.skipif(os.environ.get(BENCH_ENV) != "1", reason=f"benchmark: set {BENCH_ENV}=1")
def test_bench_init_process_group(_session_etcd_endpoint: str, unique_job: str) -> None:
    """init_process_group time over EtcdStore vs TCPStore (median of some rounds)."""
    rounds = int(os.environ.get("PEER_ELASTIC_BENCH_ROUNDS", "7"))
    ws = start_workers(_session_etcd_endpoint, 4)
    rows = []
    try:
        keys = RunKeys(unique_job, "run0")
        gen = 0
        for world in (2, 4):
            for kind in ("etcd", "tcp"):
                samples = []
                for _ in range(rounds):
                    gen += 1
                    out = run_group(ws[:world], prefix=keys.store_prefix(gen), store=kind,
                                    port=free_port(), start_at=time.time() + 0.3)
                    assert all(r["ok"] for r in out), out
                    # The group is formed when its slowest rank returns from init.
                    samples.append(max(r["init_s"] for r in out))
                samples.sort()
                rows.append((world, kind, samples[len(samples) // 2], samples[0], samples[-1]))
    finally:
        for w in ws:
            w.close()
    print("\nworld store   median_ms  min_ms  max_ms  (store creation + init_process_group)")
    for world, kind, med, lo, hi in rows:
        print(f"{world:5d} {kind:6s} {med * 1e3:9.1f} {lo * 1e3:7.1f} {hi * 1e3:7.1f}")


# --- the worker side --------------------------------------------------------------------------


def _form_group(client: EtcdClient, cmd: dict[str, Any]) -> dict[str, Any]:
    """Form a gloo group as ``cmd`` says, all_reduce + barrier on it, destroy it."""
    rank, world = cmd["rank"], cmd["world"]
    if cmd.get("start_at"):
        time.sleep(max(0.0, cmd["start_at"] - time.time()))
    timeout = timedelta(seconds=cmd.get("timeout_s", 20))
    t0 = time.monotonic()
    abort = None
    if cmd.get("abort_after") is not None:
        abort_at = t0 + cmd["abort_after"]

        def abort() -> str | None:
            return "peer gone" if time.monotonic() >= abort_at else None

    def init() -> dict[str, Any] | None:
        # The store is referenced only here: afterwards only torch holds it, as in
        # peer_elastic.torch.group, so new_group below checks that it stays usable.
        store: dist.Store
        if cmd.get("store", "etcd") == "tcp":
            store = dist.TCPStore("127.0.0.1", cmd["port"], world, rank == 0, timeout=timeout)
        else:
            store = EtcdStore(client, cmd["prefix"], timeout=timeout, abort=abort)
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timeout)
        except Exception as exc:
            if isinstance(store, EtcdStore):
                store.close()
            if not dist.is_initialized():
                # torch 2.13 numbers default groups from a counter that a failed init
                # leaves incremented and only destroy_process_group resets; left alone,
                # this rank's next rendezvous would use other keys ("1//cpu//...") than
                # its peers' ("0//cpu//...") and wait for them in vain.
                dist.distributed_c10d._world.group_count = 0
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "elapsed": time.monotonic() - t0,
                    "is_dist_error": isinstance(exc, dist.DistError),
                    "abort_reason": getattr(store, "abort_reason", None),
                    "initialized": dist.is_initialized()}
        return None

    failed = init()
    if failed is not None:
        return failed
    init_s = time.monotonic() - t0
    gc.collect()
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        dist.barrier()
        out: dict[str, Any] = {"ok": True, "sum": t.item(), "init_s": init_s}
        if cmd.get("new_group"):
            g = dist.new_group(list(range(world)))
            u = torch.tensor([float(rank + 1)])
            dist.all_reduce(u, group=g)
            out["sub_sum"] = u.item()
        return out
    finally:
        dist.destroy_process_group()


def _worker_main(endpoint: str) -> None:
    client = EtcdClient(endpoint)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # EOF (the test closed stdin, or died) ends the worker
        cmd = json.loads(line)
        try:
            result = _form_group(client, cmd)
        except Exception as exc:
            result = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        print(json.dumps(result), flush=True)
    client.close()


if __name__ == "__main__":
    _worker_main(sys.argv[1])
