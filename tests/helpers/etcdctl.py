"""etcd's own command-line client, for tests that set up etcd (users, roles) behind the
client's back."""

from __future__ import annotations

import os
import subprocess

from peer_elastic.etcd_server import EtcdServer, find_etcd_binary


def etcdctl(server: EtcdServer, *args: str, user: str | None = None) -> str:
    """``etcdctl ARGS`` against ``server`` (as ``user``, if given): its output; fails the
    test unless it exits 0. The etcdctl next to the etcd binary, else the one on PATH."""
    ctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    cmd = [ctl if os.path.exists(ctl) else "etcdctl", f"--endpoints={server.endpoint}", *args]
    if user:
        cmd.insert(2, f"--user={user}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout
