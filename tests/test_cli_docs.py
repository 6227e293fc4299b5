"""docs/cli.md and the command agree: the exit codes, the subcommands and their flags, the
variables ``run`` exports, and the ``status --json`` fields of a real job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer_elastic.cli import ExitCode
from peer_elastic.cli.parser import build_command_line
from peer_elastic.cli.run import peer_environment
from peer_elastic.config import JOB_FIELDS, JobSettings
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.snapshot_records import record_snapshot
from peer_elastic.records import PaceRecord, PeerPace, SnapshotRecord, encode
from peer_elastic.settings_table import ETCD, JOB, LOG_LEVEL

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "cli.md").read_text()


def section(title: str, level: int = 2, text: str = DOC) -> str:
    """The text under the heading ``title`` (of ``level`` #s) up to the next of its level or
    higher."""
    head = "#" * level + " " + title + "\n"
    assert head in text, f"docs/cli.md lacks the heading {head.strip()!r}"
    body = text.split(head, 1)[1]
    return re.split(rf"^#{{1,{level}}} ", body, maxsplit=1, flags=re.M)[0]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``text``, cells stripped."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or re.match(r"^\|[\s:|-]+\|$", line):
            continue
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [r for r in rows if r[0] not in ("Code", "Field", "Variable", "Option")]


def first_column_names(text: str) -> set[str]:
    return {re.sub(r"`|\[\]", "", row[0]) for row in table_rows(text)}


def test_exit_code_table_is_the_enum() -> None:
    rows = table_rows(section("Exit codes"))
    documented = {int(code): name.strip("`") for code, name, _meaning in rows}
    assert documented == {c.value: c.name for c in ExitCode}


def test_exit_codes_agree_with_the_peers_own() -> None:
    from peer_elastic.api import EXIT_HUNG, EXIT_JOB_FAILED

    assert ExitCode.JOB_FAILED == EXIT_JOB_FAILED  # run passes a failed job's code on
    assert EXIT_HUNG not in set(ExitCode)  # never mistaken for a peer's hang


def test_every_subcommand_and_flag_is_documented() -> None:
    cl = build_command_line()
    setting_flags = {"--" + f.name.removesuffix("_s").replace("_", "-") for f in JOB_FIELDS}
    common = {"-h", "--help", "-v", "--verbose", "--log-level"}
    shared = section("Options of every subcommand")  # and the --etcd/--job/--timeout table
    for name, parser in cl.commands.items():
        assert parser.description, f"{name} has no description"
        text = section(f"`peer-elastic {name}`", level=3)
        flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", parser.format_usage()))
        for flag in flags - common - setting_flags:
            # run's own --etcd and --job differ from the shared ones: run documents them
            documented = text if name == "run" else text + shared
            assert f"`{flag}" in documented, f"docs/cli.md: {name} lacks {flag}"
    everywhere = first_column_names(shared)
    assert {"--log-level LEVEL", "-v, --verbose", "--version", "--etcd ENDPOINTS",
            "--job NAME", "--timeout SECONDS"} <= everywhere


def test_the_variables_run_exports_are_documented() -> None:
    text = section("Environment", level=4, text=section("`peer-elastic run`", level=3))
    tables = text.split("What each peer gets", 1)
    assert len(tables) == 2, "the Environment section names what each peer gets"
    exported = first_column_names(tables[1])
    launch = set(peer_environment({}, 0, 1, 1))  # what run adds beside the job's variables
    assert exported == launch | {JOB.env, ETCD.env, LOG_LEVEL.env}
    read = first_column_names(tables[0])
    assert {JOB.env, ETCD.env, LOG_LEVEL.env} <= read


def status_fields(sub: str) -> set[str]:
    return first_column_names(section(sub, level=3, text=section("`status --json`")))


@pytest.mark.timeout(180)
def test_status_json_fields_are_the_documented_ones(etcd: str, unique_job: str) -> None:
    client = EtcdClient(etcd)
    c = Coordinator(client, unique_job, JobSettings(start_settle_s=0.1)).start()
    try:
        c.wait_generation(0, timeout=30)
        # Every part of the document present: progress, a snapshot, the outcome.
        c.record_progress(generation=1, epoch=1, batch=2, step=3, world_size=1, commits=3)
        assert c.keys is not None
        client.put(c.keys.pace, encode(PaceRecord(generation=1, unix=time.time(), step_s=0.1,
                                                 peers=[PeerPace(member_id=c.member_id,
                                                                 score=1.0, own_s=0.1)])))
        record_snapshot(client, unique_job, SnapshotRecord(
            name="snap-00000003", path="/shared/s", commits=3, epoch=1, step=3,
            checksum="0" * 64, unix=time.time(), host="h1", run_id="r1"))
        c.finish(True, "training function returned")
        r = subprocess.run([sys.executable, "-m", "peer_elastic.cli", "status", "--etcd", etcd,
                            "--job", unique_job, "--json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ))
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
    finally:
        c.close()
        client.close()
    assert set(doc) == status_fields("Top level")
    assert set(doc["members"][0]) == status_fields("`members[]`")
    for part in ("progress", "pace", "snapshot", "done"):
        assert doc[part] is not None, part
        assert set(doc[part]) == status_fields(f"`{part}`"), part
    assert set(doc["config"]) == {f.name for f in JOB_FIELDS}
