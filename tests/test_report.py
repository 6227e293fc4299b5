"""peer-elastic report: world size and throughput over time with every event marked, from
a run's keys in etcd, during the run and after its last peer left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from peer_elastic.config import JobSettings
from peer_elastic.etcd.client import EtcdClient
from peer_elastic.etcd.coordinator import Coordinator
from peer_elastic.ops.timeline import read_timeline
from peer_elastic.records import ProgressRecord

ROOT = Path(__file__).resolve().parents[1]
# min_np 2: the first generation waits for the second peer, however slowly a loaded machine
# starts it (a settle window alone may close on one).
FAST = JobSettings(min_np=2, start_settle_s=0.2, settle_s=0.05, lease_ttl_s=3,
                   join_timeout_s=1.0)
SVG = "{http://www.w3.org/2000/svg}"


def report(etcd: str, job: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer_elastic.cli", "report", "--etcd", etcd,
                           "--job", job, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ))


def test_report_draws_world_size_throughput_and_every_event(etcd: str, unique_job: str,
                                                            tmp_path: Path) -> None:
    client = EtcdClient(etcd)
    coords: list[Coordinator] = []
    clients = [client]

    def join() -> Coordinator:
        clients.append(EtcdClient(etcd))
        return Coordinator(clients[-1], unique_job, FAST).start()

    try:
        def size(n: int) -> None:
            assert coords[0].view.wait_for(lambda s: s.generation is not None
                                           and len(s.generation.roster) == n, 20)

        coords += [join(), join()]
        size(2)
        coords.append(join())
        size(3)
        now = time.time()
        for i in range(5):  # one step a second, stamped: a known throughput of 10 steps/s
            coords[0].writer.progress(ProgressRecord(unix=now - 5 + i, step=10 * i,
                                                     generation=2, world_size=3))
        coords.pop().close()
        size(2)

        timeline = read_timeline(client, unique_job)
        assert [g.world_size for g in timeline.generations] == [2, 3, 2]
        assert [g.causes for g in timeline.generations] == [("first",), ("joined",), ("left",)]
        assert [round(v) for _, v in timeline.throughput()] == [10] * 4

        r = report(etcd, unique_job, tmp_path / "run.svg")
        assert r.returncode == 0, r.stderr
        svg = ET.parse(tmp_path / "run.svg").getroot()  # well-formed, stand-alone SVG
        marks = [e for e in svg.iter(f"{SVG}line") if e.get("class") == "event"]
        assert len(marks) == len(timeline.events) and len(svg.findall(f"{SVG}path")) == 2
        assert {m.get("data-kind") for m in marks} >= {"joined", "generation", "left"}

        for c in coords:  # the run ends; its keys stay for run_ttl_s
            c.close()
        coords.clear()
        r = report(etcd, unique_job, tmp_path / "run.html")
        assert r.returncode == 0, r.stderr
        html = (tmp_path / "run.html").read_text()
        assert html.count('class="event"') >= len(marks) and "<svg" in html
    finally:
        for c in coords:
            c.close()
        for cl in clients:
            cl.close()
