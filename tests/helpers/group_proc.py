"""A peer that only forms process groups (no training), for rendezvous tests.

Usage: python -m tests.helpers.group_proc  (etcd, job and settings from PEER_ELASTIC_*)

Prints one line per fact, flushed: ``MEMBER <id>``, ``FORMED <generation> <rank> <size>``,
``SUM <generation> <value>`` (a 1-element all-reduce of ones on the new group),
``BROKEN <generation> <error>`` when that all-reduce failed, ``SUPERSEDED <generation>``,
``TIMEOUT <generation> <seconds>``: the formed group's collective timeout.

``GROUP_PROC_SUPERSEDE=K`` makes the supersession of a generation during its rendezvous
certain instead of a race, in this peer's first K rendezvous: once
this peer has written its own rendezvous key (torch's, e.g. gloo's address), it marks the
generation broken and waits until the leader has proposed a newer one, then lets the
rendezvous go on. Its peers have read, or are about to read, that key by then.

``GROUP_PROC_DIE_IN_RENDEZVOUS=1`` makes this peer SIGKILL itself in its first rendezvous
with others, right after writing its own rendezvous key: its peers are connecting to it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from peer_elastic.config import JobSettings
from peer_elastic.errors import JobFinished
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.etcd.keys import KeyKind, parse
from peer_elastic.process.probe_listener import ProbeListener
from peer_elastic.torch.group import GroupManager, is_collective_failure
from peer_elastic.torch.store import EtcdStore


def supersede_after_own_key(coord: Coordinator, times: int) -> None:
    """Patch :class:`EtcdStore` so that ``times`` rendezvous are superseded mid-way."""
    real_set = EtcdStore.set
    fired: set[str] = set()
    left = [times]

    def set_then_supersede(self: EtcdStore, key: str, value: bytes | str) -> None:
        real_set(self, key, value)
        parsed = parse(self.prefix + key)
        if (parsed is None or parsed.kind is not KeyKind.STORE or left[0] <= 0
                or "\x00" in self.prefix + key or self.prefix in fired):
            return
        fired.add(self.prefix)
        left[0] -= 1
        n = parsed.generation
        coord.mark_broken(n, "test: superseded during the rendezvous")
        deadline = time.monotonic() + 60
        while coord.snapshot().generation_number <= n and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"SUPERSEDED {n}", flush=True)

    EtcdStore.set = set_then_supersede  # type: ignore[method-assign]


def die_after_own_key() -> None:
    """Patch :class:`EtcdStore` so that this process dies right after its first rendezvous
    key in a group of more than one."""
    real_set = EtcdStore.set

    def set_then_die(self: EtcdStore, key: str, value: bytes | str) -> None:
        real_set(self, key, value)
        parsed = parse(self.prefix + key)
        if parsed is not None and parsed.kind is KeyKind.STORE and "\x00" not in key:
            print(f"DYING {parsed.generation}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    EtcdStore.set = set_then_die  # type: ignore[method-assign]


def main() -> int:
    endpoints, job = os.environ["PEER_ELASTIC_ETCD"], os.environ["PEER_ELASTIC_JOB"]
    settings = JobSettings.from_env()
    client = EtcdClient(endpoints, retry_budget_s=30)
    # As pe.join() does: a probe listener on the group address, so a death is provable.
    probe = ProbeListener("127.0.0.1")
    coord = Coordinator(client, job, settings, net_address="127.0.0.1",
                        probe_port=probe.port).start()
    print(f"MEMBER {coord.member_id}", flush=True)
    times = int(os.environ.get("GROUP_PROC_SUPERSEDE", "0"))
    if times:
        supersede_after_own_key(coord, times)
    if os.environ.get("GROUP_PROC_DIE_IN_RENDEZVOUS") == "1":
        die_after_own_key()
    groups = GroupManager(coord, "gloo", collective_timeout_s=float(
        os.environ.get("PEER_ELASTIC_COLLECTIVE_TIMEOUT", "30")))
    last = 0
    try:
        while True:
            group = groups.form(after=last)
            last = group.generation
            print(f"FORMED {last} {group.assignment.rank} {group.assignment.size}", flush=True)
            gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            print(f"TIMEOUT {last} {gloo.options._timeout.total_seconds():g}", flush=True)
            ones = torch.ones(1)
            try:
                dist.all_reduce(ones)
                print(f"SUM {last} {int(ones.item())}", flush=True)
            except Exception as exc:
                if not is_collective_failure(exc):
                    raise
                print(f"BROKEN {last} {str(exc)[:200]}", flush=True)
                coord.mark_broken(last, f"all-reduce failed: {exc}")
    except JobFinished:
        return 0
    finally:
        groups.destroy()
        coord.close()
        client.close()
        probe.close()


if __name__ == "__main__":
    sys.exit(main())
