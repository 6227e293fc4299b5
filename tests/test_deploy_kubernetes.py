"""deploy/kubernetes/: the manifests validate against Kubernetes' schemas, and every variable
they give a peer is one peer-elastic reads (as tests/test_deploy.py checks for systemd)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from peer_elastic import settings_table
from peer_elastic.settings_table import Scope

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# The newest schema kubernetes-validate ships, and an older release still in support.
VERSIONS = sorted({kubernetes_validate.latest_version(), "1.31.0"})


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_manifests_exist() -> None:
    assert {p.name for p in MANIFESTS} >= {"etcd.yaml", "peers.yaml"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,doc", documents(),
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in documents()])
def test_manifest_validates(name: str, doc: dict[str, Any], version: str) -> None:
    # strict: unknown fields (a typo in a field name) fail too.
    kubernetes_validate.validate(doc, version, strict=True)


def test_validation_catches_a_broken_manifest() -> None:
    doc = one("Deployment", "peer-elastic")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 120  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def peer_workloads() -> list[dict[str, Any]]:
    """Workloads whose pods run a peer: they take the peer-elastic-settings ConfigMap."""
    out = []
    for kind in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        for doc in by_kind(kind):
            containers = doc["spec"]["template"]["spec"]["containers"]
            if any(ref.get("configMapRef", {}).get("name") == "peer-elastic-settings"
                   for c in containers for ref in c.get("envFrom", [])):
                out.append(doc)
    return out


def peer_env(doc: dict[str, Any]) -> dict[str, Any]:
    """Every variable a peer container gets: envFrom ConfigMaps' keys, then env entries."""
    env: dict[str, Any] = {}
    for c in doc["spec"]["template"]["spec"]["containers"]:
        for ref in c.get("envFrom", []):
            cm = one("ConfigMap", ref["configMapRef"]["name"])
            env.update(cm["data"])
        for item in c.get("env", []):
            env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def test_there_is_a_peer_workload() -> None:
    assert [d["metadata"]["name"] for d in peer_workloads()] == ["peer-elastic"]


def test_manifests_set_only_variables_a_peer_reads() -> None:
    for doc in peer_workloads():
        for name in peer_env(doc):
            try:
                var = settings_table.by_env(name)
            except KeyError:
                pytest.fail(f"{doc['metadata']['name']} sets {name}, which peer-elastic does "
                            "not read (peer_elastic/settings_table.py)")
            assert var.scope is not Scope.TOOL, f"{name} is a tool setting, not a peer's"


def test_configmap_values_are_valid() -> None:
    for key, value in one("ConfigMap", "peer-elastic-settings")["data"].items():
        assert isinstance(value, str), f"{key}: ConfigMap values must be strings"
        settings_table.by_env(key).value({key: value})  # raises ConfigError if invalid


def test_host_is_the_node_name_from_the_downward_api() -> None:
    env = peer_env(one("Deployment", "peer-elastic"))
    assert env[settings_table.HOST.env] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_tls_files_come_from_the_mounted_secret() -> None:
    doc = one("Deployment", "peer-elastic")
    spec = doc["spec"]["template"]["spec"]
    env = peer_env(doc)
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for c in spec["containers"]
              for m in c.get("volumeMounts", [])}
    for var in (settings_table.ETCD_CA, settings_table.ETCD_CERT, settings_table.ETCD_KEY):
        path = Path(env[var.env])
        assert str(path.parent) in mounts, f"{var.env}={path}: no volume mounted there"
        assert mounts[str(path.parent)] in secrets, f"{var.env}: not from a Secret"
    assert all(e.startswith("https://") for e in env[settings_table.ETCD.env].split(","))


def test_peer_pods_leave_gracefully_and_request_resources() -> None:
    spec = one("Deployment", "peer-elastic")["spec"]["template"]["spec"]
    # Like TimeoutStopSec=120 of the systemd unit: a leave takes up to the next commit.
    assert spec["terminationGracePeriodSeconds"] >= 60
    for c in spec["containers"]:
        assert "preStop" in c["lifecycle"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        assert c["command"][0] != "/bin/sh", "python must be PID 1 to receive SIGTERM"


def test_etcd_is_three_members_behind_a_headless_service() -> None:
    sts = one("StatefulSet", "etcd")
    svc = one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["replicas"] == 3
    container = sts["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in container["command"][1:] if "=" in a)
    members = flags["--initial-cluster"].split(",")
    assert [m.split("=")[0] for m in members] == [f"etcd-{i}" for i in range(3)]
    assert all(f".{svc['metadata']['name']}." in m for m in members)
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert "requests" in container["resources"]
    # The peers' endpoints are the members' stable names.
    endpoints = one("ConfigMap", "peer-elastic-settings")["data"][settings_table.ETCD.env]
    assert [e.split("//")[1].split(".")[0] for e in endpoints.split(",")] == \
        [f"etcd-{i}" for i in range(3)]
