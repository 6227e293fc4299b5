"""Temp dirs that name their owners, and the sweep of those whose owners all exited
(peer_elastic.process.owned_dirs). The real case, a SIGKILLed ``peer-elastic run --standalone``,
is in tests/test_parent_death.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer_elastic.process.owned_dirs import (
    OWNERS,
    ProcessId,
    add_owner,
    make_owned_dir,
    owners,
    sweep,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def exited_process() -> ProcessId:
    """A process that existed and has exited (its pid may be reused later: the start time
    tells the two apart)."""
    child = subprocess.Popen(["sleep", "30"])
    me = ProcessId.of(child.pid)
    child.kill()
    child.wait()
    assert me is not None and not me.alive()
    return me


def owned(path: Path, *procs: ProcessId) -> Path:
    path.mkdir()
    (path / OWNERS).write_text("".join(f"{p.pid} {p.start}\n" for p in procs))
    (path / "data").write_text("x")
    return path


def test_a_process_is_its_pid_and_start_time() -> None:
    me = ProcessId.of(os.getpid())
    assert me is not None and me.alive()
    assert not ProcessId(me.pid, me.start + 1).alive()  # same pid, another process
    assert ProcessId.of(2**22 + 12345) is None  # beyond pid_max: no such process
    # A zombie (exited, not reaped yet: an orphan's new parent may never reap it) has exited.
    child = subprocess.Popen(["true"])
    zombie = ProcessId.of(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    try:
        assert Path(f"/proc/{child.pid}/stat").exists()
        assert ProcessId.of(child.pid) is None
        assert zombie is None or not zombie.alive()
    finally:
        child.wait()


def test_sweep_removes_only_dirs_whose_owners_all_exited(tmp_path: Path) -> None:
    me, gone = ProcessId.of(os.getpid()), exited_process()
    assert me is not None
    dead = owned(tmp_path / "pe-dead", gone)
    mine = owned(tmp_path / "pe-mine", me)
    mixed = owned(tmp_path / "pe-mixed", gone, me)  # e.g. its etcd exited, the launcher lives
    unowned = tmp_path / "pe-unowned"  # being created, or made elsewhere
    unowned.mkdir()
    other = owned(tmp_path / "other-dead", gone)  # another prefix
    junk = tmp_path / "pe-junk"
    junk.mkdir()
    (junk / OWNERS).write_text("not a pid\n")
    assert sweep("pe-", tmp_path) == [dead]
    assert not dead.exists()
    assert all(p.exists() for p in (mine, mixed, unowned, other, junk))


def test_an_owned_dir_names_its_maker_and_sweeps_before_it_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead = owned(tmp_path / "pe-x-old", exited_process())
    path = make_owned_dir("pe-x-", sweep_prefix="pe-")
    assert path.parent == tmp_path and path.name.startswith("pe-x-")
    assert not dead.exists()
    child = subprocess.Popen(["sleep", "30"])
    try:
        add_owner(path, child.pid)
        assert owners(path) == [ProcessId.of(os.getpid()), ProcessId.of(child.pid)]
    finally:
        child.kill()
        child.wait()
    assert sweep("pe-", tmp_path) == []  # this process still owns it
