"""Optional Prometheus metrics (peer_elastic.metrics): values, labels, the no-op fallback,
the HTTP endpoint, and one real single-peer job scraped end to end."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from peer_elastic import metrics as pm
from peer_elastic.elastic import Peer
from peer_elastic.errors import ConfigError, HostsUpdatedInterrupt
from peer_elastic.etcd.counters import CoordinatorCounters
from peer_elastic.observer import PeerStats, observed
from peer_elastic.records import GenerationCause
from peer_elastic.state import ObjectState, TorchState

REPO_ROOT = Path(__file__).resolve().parent.parent

needs_prom = pytest.mark.skipif(not pm.prometheus_available(),
                                reason="prometheus_client not installed (extra 'metrics')")
hooked = "metrics" in inspect.signature(Peer.__init__).parameters


def sample(m: pm.PeerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def fake_peer(**kw: Any) -> SimpleNamespace:
    snap = SimpleNamespace(eligible=lambda: ("m1", "m2", "m3"))
    coord = SimpleNamespace(job="jobA", host="hostA", config=SimpleNamespace(min_np=2, max_np=4),
                            latest_generation=SimpleNamespace(number=3),
                            snapshot=lambda: snap,
                            counters=CoordinatorCounters(generations_written=2, rejoins=1))
    values = {"generation": 3, "size": 2, "rank": 1, "is_leader": False,
              "coordinator": coord, "stats": PeerStats(),
              "straggler": SimpleNamespace(score=math.nan, own_s=math.nan, waited_s=math.nan)}
    values.update(kw)
    return SimpleNamespace(**values)


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode("utf-8")


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- reason classification (no prometheus_client needed) ------------------------------------------


_C = GenerationCause


@pytest.mark.parametrize(("causes", "kw", "label"), [
    ([_C.GENERATION_CAUSE_FIRST], {}, "other"),
    ([], {}, "other"),
    ([_C.GENERATION_CAUSE_BROKEN], {}, "crash"),
    ([_C.GENERATION_CAUSE_DROPPED], {}, "crash"),
    ([_C.GENERATION_CAUSE_LEFT], {}, "left"),
    ([_C.GENERATION_CAUSE_EXPIRED], {}, "left"),
    ([_C.GENERATION_CAUSE_RESIZED], {}, "left"),
    ([_C.GENERATION_CAUSE_JOINED], {}, "joined"),
    ([_C.GENERATION_CAUSE_LEFT, _C.GENERATION_CAUSE_JOINED], {}, "left"),
    ([_C.GENERATION_CAUSE_BROKEN, _C.GENERATION_CAUSE_DROPPED, _C.GENERATION_CAUSE_LEFT,
      _C.GENERATION_CAUSE_JOINED], {}, "crash"),
    ([_C.GENERATION_CAUSE_HUNG], {}, "hung"),
    ([_C.GENERATION_CAUSE_HUNG, _C.GENERATION_CAUSE_LEFT], {}, "hung"),
    ([_C.GENERATION_CAUSE_HUNG, _C.GENERATION_CAUSE_BROKEN], {}, "crash"),
    ([_C.GENERATION_CAUSE_CAPPED], {}, "other"),
    ([99], {}, "other"),  # a cause from a newer writer
    ([_C.GENERATION_CAUSE_JOINED], {"crashed": True}, "crash"),
    ([_C.GENERATION_CAUSE_LEFT], {"lease_lost": True}, "lease_lost"),
    ([_C.GENERATION_CAUSE_BROKEN], {"crashed": True, "lease_lost": True}, "lease_lost"),
])
def test_classify_reason(causes: list[int], kw: dict, label: str) -> None:
    assert pm.classify_reason(causes, **kw) == label
    assert label in pm.REASONS


# -- the no-op fallback -----------------------------------------------------------------------------


def test_without_prometheus_client_everything_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import prometheus_client` raise ImportError.
    for name in [n for n in sys.modules if n == "prometheus_client" or n.startswith("prometheus_client.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert not pm.prometheus_available()
    m = pm.PeerMetrics.create()
    assert isinstance(m, pm.NoopMetrics) and not m and not m.enabled
    monkeypatch.setenv(pm.ENV_PORT, "0")
    m = pm.PeerMetrics.from_env()
    assert isinstance(m, pm.NoopMetrics)
    assert m.address == "" and m.port is None and m.start_http_server() is None
    # Every hook is callable and harmless.
    m.bind(fake_peer())
    assert m.record_reset([_C.GENERATION_CAUSE_LEFT], 1.0) == "left"
    m.observe_commit(1.0), m.observe_check(1.0), m.observe_sync(1.0)
    m.on_check(1.0, committing=True), m.on_sync(1.0)
    m.on_reset("left: x", 1.0, crashed=False, lease_lost=False)
    state = ObjectState(epoch=0)
    calls = []
    state.attach(observed(lambda s, committing: calls.append(committing), m))
    state.commit()
    assert calls == [True] and "commit" not in vars(state)
    m.close()


def test_metrics_off_when_port_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pm.ENV_PORT, raising=False)
    assert isinstance(pm.PeerMetrics.from_env(), pm.NoopMetrics)
    monkeypatch.setenv(pm.ENV_PORT, "  ")
    assert isinstance(pm.PeerMetrics.from_env(), pm.NoopMetrics)
    assert isinstance(pm.PeerMetrics.create(enabled=False), pm.NoopMetrics)


@pytest.mark.parametrize("raw", ["abc", "-1", "65536", "1.5"])
def test_bad_port_is_a_config_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(pm.ENV_PORT, raw)
    with pytest.raises(ConfigError, match=pm.ENV_PORT):
        pm.PeerMetrics.from_env()


def test_port_plus_local_rank_past_the_range_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="local rank"):
        pm.PeerMetrics.from_env(local_rank=2, env={pm.ENV_PORT: "65535"})


# -- values and labels ------------------------------------------------------------------------------


@needs_prom
def test_gauges_read_the_peer_live() -> None:
    m = pm.PeerMetrics()
    assert sample(m, "peer_elastic_rank") == -1  # before any peer: standby-like
    peer = fake_peer()
    m.bind(peer)
    assert sample(m, "peer_elastic_generation") == 3
    assert sample(m, "peer_elastic_world_size") == 2
    assert sample(m, "peer_elastic_rank") == 1
    assert sample(m, "peer_elastic_is_leader") == 0
    assert sample(m, "peer_elastic_min_np") == 2
    assert sample(m, "peer_elastic_max_np") == 4
    assert sample(m, "peer_elastic_latest_generation") == 3
    assert sample(m, "peer_elastic_members") == 3
    assert sample(m, "peer_elastic_coordinator_generations_written_total") == 2
    assert sample(m, "peer_elastic_coordinator_rejoins_total") == 1
    assert sample(m, "peer_elastic_coordinator_dropped_total") == 0
    assert sample(m, "peer_elastic_coordinator_collectives_abandoned_total") == 0
    assert math.isnan(sample(m, "peer_elastic_straggler_score"))  # no exchange yet
    peer.straggler.score, peer.straggler.own_s, peer.straggler.waited_s = 3.0, 0.03, 0.001
    assert sample(m, "peer_elastic_straggler_score") == 3.0
    assert sample(m, "peer_elastic_step_own_seconds") == 0.03
    assert sample(m, "peer_elastic_step_waited_seconds") == 0.001
    assert sample(m, "peer_elastic_info", elastic_job="jobA", host="hostA",
                  version=__import__("peer_elastic").__version__) == 1
    peer.generation, peer.size, peer.rank, peer.is_leader = 4, 3, 0, True
    peer.coordinator.config.max_np = 8
    peer.coordinator.latest_generation = SimpleNamespace(number=5)  # a reset under way
    peer.coordinator.counters.rejoins += 1
    peer.stats.collective_abandoned()
    peer.stats.count("checks_spaced")
    assert sample(m, "peer_elastic_generation") == 4
    assert sample(m, "peer_elastic_world_size") == 3
    assert sample(m, "peer_elastic_rank") == 0
    assert sample(m, "peer_elastic_is_leader") == 1
    assert sample(m, "peer_elastic_max_np") == 8
    assert sample(m, "peer_elastic_latest_generation") == 5
    assert sample(m, "peer_elastic_coordinator_rejoins_total") == 2
    assert sample(m, "peer_elastic_coordinator_collectives_abandoned_total") == 1
    assert sample(m, "peer_elastic_coordinator_checks_spaced_total") == 1
    assert sample(m, "peer_elastic_coordinator_check_exchanges_total") == 0
    m.bind(peer)  # binding again (a new run) registers nothing twice
    assert sample(m, "peer_elastic_coordinator_rejoins_total") == 2
    peer.generation, peer.size, peer.rank = 4, 0, -1  # standby
    assert sample(m, "peer_elastic_rank") == -1


@needs_prom
def test_a_gauge_that_cannot_be_read_does_not_break_the_scrape() -> None:
    class Flaky:
        generation, size, is_leader = 1, 1, False
        coordinator, stats = fake_peer().coordinator, PeerStats()

        @property
        def rank(self) -> int:
            raise AttributeError("'NoneType' object has no attribute 'assignment'")

    m = pm.PeerMetrics()
    m.bind(Flaky())
    assert sample(m, "peer_elastic_rank") == -1
    assert sample(m, "peer_elastic_generation") == 1
    assert "peer_elastic_rank -1.0" in m.render()


@needs_prom
def test_resets_are_counted_by_a_bounded_reason() -> None:
    m = pm.PeerMetrics()
    for reason in pm.REASONS:  # every series exists at 0 before the first reset
        assert sample(m, "peer_elastic_resets_total", reason=reason) == 0
    assert m.record_reset([_C.GENERATION_CAUSE_LEFT], 0.25) == "left"
    assert m.record_reset([_C.GENERATION_CAUSE_JOINED], 0.5) == "joined"
    assert m.record_reset([_C.GENERATION_CAUSE_JOINED], 0.125, crashed=True) == "crash"
    assert m.record_reset([_C.GENERATION_CAUSE_JOINED], 2.0, lease_lost=True) == "lease_lost"
    assert m.record_reset([_C.GENERATION_CAUSE_HUNG], 1.5) == "hung"
    assert m.record_reset([], 0.75) == "other"
    for reason in pm.REASONS:
        assert sample(m, "peer_elastic_resets_total", reason=reason) == 1
    assert sample(m, "peer_elastic_last_recovery_seconds") == 0.75
    labels = {s.labels.get("reason") for fam in m.registry.collect()
              if fam.name == "peer_elastic_resets" for s in fam.samples}
    assert labels == set(pm.REASONS)  # no member id ever becomes a label
    assert "host-9" not in m.render()


@needs_prom
def test_histograms_and_their_buckets() -> None:
    m = pm.PeerMetrics()
    m.observe_commit(0.003)
    m.observe_check(0.00004)
    m.observe_sync(1.5)
    assert sample(m, "peer_elastic_commit_seconds_count") == 1
    assert sample(m, "peer_elastic_commit_seconds_bucket", le="0.005") == 1
    assert sample(m, "peer_elastic_commit_seconds_bucket", le="0.0025") == 0
    assert sample(m, "peer_elastic_check_seconds_bucket", le="5e-05") == 1
    assert sample(m, "peer_elastic_sync_seconds_bucket", le="2.5") == 1
    assert sample(m, "peer_elastic_sync_seconds_bucket", le="1.0") == 0
    assert sample(m, "peer_elastic_sync_seconds_sum") == 1.5
    for buckets in (pm.COMMIT_BUCKETS, pm.CHECK_BUCKETS, pm.SYNC_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


@needs_prom
def test_each_peer_has_its_own_registry() -> None:
    from prometheus_client import REGISTRY

    a, b = pm.PeerMetrics(), pm.PeerMetrics()  # would raise "Duplicated timeseries" if shared
    a.record_reset([_C.GENERATION_CAUSE_LEFT], 1.0)
    assert sample(a, "peer_elastic_resets_total", reason="left") == 1
    assert sample(b, "peer_elastic_resets_total", reason="left") == 0
    assert REGISTRY.get_sample_value("peer_elastic_resets_total", {"reason": "left"}) is None


@needs_prom
@pytest.mark.parametrize("make", [lambda: ObjectState(epoch=0),
                                  lambda: TorchState(model=None, optimizer=None, epoch=0)])
def test_observed_check_times_commit_and_check(make: Any) -> None:
    m = pm.PeerMetrics()
    state = make()
    outcome: list[BaseException | None] = [None]

    def checker(s: Any, committing: bool) -> None:
        if outcome[0] is not None:
            raise outcome[0]
        if committing:
            s.record_commit()

    state.attach(observed(checker, m))  # as Peer.run attaches Peer._check with metrics on
    for _ in range(3):
        state.commit()
    state.check_host_updates()
    assert sample(m, "peer_elastic_commit_seconds_count") == 3
    assert sample(m, "peer_elastic_check_seconds_count") == 4  # 3 inside commit + 1 direct
    assert state.commit_count == 3
    outcome[0] = HostsUpdatedInterrupt(skip_sync=True)  # observed: the check ran
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert sample(m, "peer_elastic_commit_seconds_count") == 4
    assert sample(m, "peer_elastic_check_seconds_count") == 5
    outcome[0] = RuntimeError("Connection closed by peer")  # a failed collective: not observed
    with pytest.raises(RuntimeError):
        state.commit()
    assert sample(m, "peer_elastic_commit_seconds_count") == 4
    assert sample(m, "peer_elastic_check_seconds_count") == 5
    assert "commit" not in vars(state)  # nothing replaced on the state
    state.attach(None)
    state.commit()  # detached: untimed
    assert sample(m, "peer_elastic_commit_seconds_count") == 4
    if isinstance(state, ObjectState):
        assert "commit" not in state._names  # never became a state value


@needs_prom
def test_step_observer_hooks_feed_the_metrics() -> None:
    m = pm.PeerMetrics()
    m.on_sync(0.5)
    m.on_reset([GenerationCause.GENERATION_CAUSE_LEFT], 0.25, crashed=False, lease_lost=False)
    m.on_reset([GenerationCause.GENERATION_CAUSE_LEFT], 0.5, crashed=True, lease_lost=False)
    assert sample(m, "peer_elastic_sync_seconds_count") == 1
    assert sample(m, "peer_elastic_resets_total", reason="left") == 1
    assert sample(m, "peer_elastic_resets_total", reason="crash") == 1
    assert sample(m, "peer_elastic_last_recovery_seconds") == 0.5


# -- HTTP -------------------------------------------------------------------------------------------


@needs_prom
def test_http_endpoint_on_an_ephemeral_port() -> None:
    m = pm.PeerMetrics()
    m.bind(fake_peer(generation=5, size=3, rank=2, is_leader=True))
    m.record_reset([_C.GENERATION_CAUSE_DROPPED], 1.25)
    m.observe_commit(0.001)
    try:
        port = m.start_http_server(0, "127.0.0.1")
        assert port > 0 and m.port == port
        assert m.address == f"127.0.0.1:{port}"
        assert m.start_http_server(0) == port  # idempotent while serving
        values = parse(scrape(port))
        assert values[("peer_elastic_generation", ())] == 5
        assert values[("peer_elastic_world_size", ())] == 3
        assert values[("peer_elastic_rank", ())] == 2
        assert values[("peer_elastic_is_leader", ())] == 1
        assert values[("peer_elastic_resets_total", (("reason", "crash"),))] == 1
        assert values[("peer_elastic_resets_total", (("reason", "joined"),))] == 0
        assert values[("peer_elastic_last_recovery_seconds", ())] == 1.25
        assert values[("peer_elastic_commit_seconds_count", ())] == 1
        assert values[("peer_elastic_commit_seconds_bucket", (("le", "+Inf"),))] == 1
        assert not any(name.startswith("python_") or name.startswith("process_")
                       for name, _ in values)  # only this peer's registry is served
    finally:
        m.close()
    assert m.port is None and m.address == ""
    with pytest.raises(urllib.error.URLError):
        scrape(port)


@needs_prom
def test_from_env_serves_and_offsets_by_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    first = pm.PeerMetrics.from_env(env={pm.ENV_PORT: "0"})
    try:
        assert first.enabled and first.port
        base = first.port
    finally:
        first.close()
    # A fixed port: the peer in local slot 1 listens on port + 1 (the base port is now free;
    # its neighbour most likely is; retry once on a clash with an unrelated process).
    m = pm.PeerMetrics.from_env(local_rank=1, env={pm.ENV_PORT: str(base - 1),
                                                    pm.ENV_ADDR: "127.0.0.1"})
    try:
        if m.enabled:
            assert m.port == base and m.address == f"127.0.0.1:{base}"
            assert "peer_elastic_rank" in scrape(m.port)
    finally:
        m.close()


@needs_prom
def test_a_port_in_use_leaves_metrics_off_and_training_on(caplog: pytest.LogCaptureFixture) -> None:
    busy = pm.PeerMetrics()
    port = busy.start_http_server(0)
    try:
        m = pm.PeerMetrics.from_env(env={pm.ENV_PORT: str(port)})
        assert isinstance(m, pm.NoopMetrics) and m.address == ""
        assert "without metrics" in caplog.text
    finally:
        busy.close()


@needs_prom
def test_wildcard_address_publishes_the_host_name() -> None:
    m = pm.PeerMetrics()
    try:
        port = m.start_http_server(0, "0.0.0.0", host_name="node-7")
        assert m.address == f"node-7:{port}"
        assert "peer_elastic_generation" in scrape(port)
    finally:
        m.close()


@needs_prom
def test_old_prometheus_client_that_returns_no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    # prometheus_client < 0.20: start_http_server returns None, so port 0 is picked first.
    import prometheus_client

    calls = []
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda port, addr="0.0.0.0", registry=None: calls.append((port, addr)))
    monkeypatch.setattr(pm, "_returns_server", lambda: False)
    m = pm.PeerMetrics()
    port = m.start_http_server(0, "127.0.0.1")
    assert calls == [(port, "127.0.0.1")] and port > 0
    assert m.port == port and m.address == f"127.0.0.1:{port}"
    m.close()  # nothing to stop; must not fail


def test_version_parsing() -> None:
    assert pm._version_tuple("0.17.1") == (0, 17)
    assert pm._version_tuple("0.20.0rc1") == (0, 20)
    assert pm._version_tuple("1.0") >= pm._RETURNS_SERVER_SINCE


# -- end to end: a real peer (needs the hooks in elastic.py / api.py) -------------------------------

WORKER = textwrap.dedent("""
    import json, sys, urllib.request
    import peer_elastic as pe

    out = {}
    with pe.join(job=sys.argv[1], etcd=sys.argv[2], min_np=1, max_np=1, start_settle_s=0.0,
                 handle_sigterm=False) as peer:
        state = pe.ObjectState(step=0)

        def train(state):
            for _ in range(5):
                state.step += 1
                state.commit()
            state.check_host_updates()
            url = f"http://127.0.0.1:{peer.metrics.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                out["text"] = resp.read().decode()
            out["address"] = peer.metrics.address
            out["port"] = peer.metrics.port
            members = peer.coordinator.snapshot().by_age
            out["published"] = [m.record.address for m in members if m.id == peer.member_id]
            from peer_elastic.etcd.admin import job_status

            doc = job_status(peer.coordinator.client, sys.argv[1])
            out["status"] = [m.get("address") for m in doc["members"]]
            return state.step

        out["result"] = peer.run(train, state)
        out["resets"] = peer.resets
    print("OUT " + json.dumps(out), flush=True)
""")


@needs_prom
@pytest.mark.skipif(not hooked, reason="metrics hooks not yet in peer_elastic.elastic.Peer")
@pytest.mark.slow
def test_single_peer_job_is_scraped_end_to_end(etcd: str, unique_job: str, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PEER_ELASTIC_METRICS_PORT="0", PEER_ELASTIC_METRICS_ADDR="127.0.0.1",
               PEER_ELASTIC_BACKEND="gloo")
    env.pop("PEER_ELASTIC_LOCAL_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script), unique_job, etcd], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("OUT "))
    out = json.loads(line[4:])
    assert out["result"] == 5 and out["resets"] == 0
    assert out["address"] == f"127.0.0.1:{out['port']}"
    assert out["published"] == [out["address"]]  # in the member record, for `status`
    assert out["status"] in ([out["address"]], [None])  # [None]: status does not show it yet
    values = parse(out["text"])
    assert values[("peer_elastic_generation", ())] == 1
    assert values[("peer_elastic_world_size", ())] == 1
    assert values[("peer_elastic_rank", ())] == 0
    assert values[("peer_elastic_is_leader", ())] == 1
    assert values[("peer_elastic_latest_generation", ())] == 1
    assert values[("peer_elastic_members", ())] == 1
    assert values[("peer_elastic_coordinator_generations_written_total", ())] == 1
    assert values[("peer_elastic_commit_seconds_count", ())] == 5
    assert values[("peer_elastic_check_seconds_count", ())] == 6
    assert sum(v for (name, _), v in values.items() if name == "peer_elastic_resets_total") == 0
    assert not math.isnan(values[("peer_elastic_min_np", ())])
