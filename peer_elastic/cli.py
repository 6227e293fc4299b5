"""The ``peer-elastic`` command.

Exit codes: 0 success; 1 a command failed; 2 bad usage or settings; 3 etcd unreachable;
4 the job failed as a whole (reset limit, elastic timeout); 130 interrupted. ``run``
returns the first non-zero exit code of its peers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer_elastic.config import JOB_FIELDS
from peer_elastic.errors import ConfigError, EtcdError, EtcdUnavailable, PeerElasticError
from peer_elastic.ops.multiplex import Multiplexer, OutputOptions, unknown_role
from peer_elastic.parent_death import die_with_parent
from peer_elastic.settings_table import ETCD, HOST, JOB, LOCAL_RANK
from peer_elastic.signal_relay import SignalRelay

if TYPE_CHECKING:  # imported where used: the etcd client is slow to import
    from peer_elastic.ops.ranks import RankTracker

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ETCD, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

#: Commands that only talk to etcd and print. Nothing of theirs needs the interpreter's
#: orderly exit (no child process, no server, no etcd of their own), and that exit can
#: hang after their work is done: a ``status`` that had printed its answer and returned did
#: not exit for 60 s, twice in the suite (a job whose run appeared meanwhile). So the
#: console script ends them at once, with everything written out (:func:`entry`).
ONE_SHOT_COMMANDS = frozenset({"status", "drain", "events", "snapshots", "set", "pause",
                               "resume", "report"})


def _setting_flags(p: argparse.ArgumentParser) -> None:
    for f in JOB_FIELDS:
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        p.add_argument(flag, dest=f.name, type=f.kind, default=None,
                       help=f"{f.help} [{f.env}, default {f.default}]")


def _job_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--etcd / --job / --timeout: how every command that talks to a job finds it."""
    p.add_argument("--etcd", default=ETCD.raw(), help=f"etcd endpoints [{ETCD.env}]")
    p.add_argument("--job", default=JOB.raw(), help=f"job name [{JOB.env}]")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to keep trying to reach etcd (default 5)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer-elastic",
        description="Elastic PyTorch training with no central driver; peers meet in etcd.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start N identical local peers running CMD",
                         description="Start N identical peers running CMD, with the job's "
                         "settings in their environment. Ctrl-C / SIGTERM makes them leave "
                         "gracefully. The exit code is the job's.")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--etcd", help="etcd endpoints, comma-separated (host:port or URLs)")
    where.add_argument("--standalone", action="store_true",
                       help="start an embedded etcd on a free loopback port for this run")
    run.add_argument("--job", default=None, help="job name (default: a fresh name)")
    run.add_argument("-n", "--nproc", type=int, required=True, help="number of peers to start")
    run.add_argument("--log-dir", type=Path, default=None,
                     help="write each peer's output to DIR/peer-<i>.log instead of the terminal")
    run.add_argument("--tee", action="store_true",
                     help="with --log-dir: write to the terminal as well")
    _setting_flags(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    etcd = sub.add_parser("etcd", help="run a single-node etcd for development")
    etcd.add_argument("--data-dir", required=True)
    etcd.add_argument("--port", type=int, default=2379)

    status = _job_flags(sub.add_parser("status",
                                       help="show a job's generation, members and progress"))
    status.add_argument("--json", action="store_true", help="machine-readable output")

    events = _job_flags(sub.add_parser(
        "events", help="show a job's event log",
        description="Joins, leaves, expiries, drains, blacklisting, and every generation "
        "formed with its cause and timing breakdown."))
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--json", action="store_true", help="one JSON object per line")

    setp = _job_flags(sub.add_parser(
        "set", help="change settings of a running job",
        description="Change settings of a running job, e.g. min_np=3 max_np=8. Peers pick "
        "them up at their next step; no restart."))
    setp.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    _job_flags(sub.add_parser("pause", help="freeze the roster: joiners wait as standbys"))
    _job_flags(sub.add_parser("resume", help="let joiners in again"))

    drain = _job_flags(sub.add_parser(
        "drain", help="ask one peer (or, with --all, every peer) to leave gracefully",
        description="Ask one peer to leave gracefully; with --all, stop the whole job "
        "gracefully: every peer leaves, rank 0 writes a final durable snapshot (with a "
        "snapshot_dir), and starting the job again resumes from it."))
    drain.add_argument("member_id", nargs="?")
    drain.add_argument("--all", action="store_true", help="every member: stop the job")

    snaps = _job_flags(sub.add_parser(
        "snapshots", help="list a job's durable snapshots (from their etcd records)"))
    snaps.add_argument("--json", action="store_true", help="machine-readable output")

    dash = _job_flags(sub.add_parser(
        "dashboard", help="serve a read-only web page of a job",
        description="Members, the generation timeline with causes, recovery timings, "
        "progress and settings, updated twice a second. Read-only; no authentication of "
        "its own: it binds loopback unless --host says otherwise. It answers requests for "
        "loopback names, IP addresses, the listen address and --allow-host names only."))
    dash.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    dash.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                      help="a host name the page may be reached by (a proxy's, this "
                      "machine's); repeatable. Requests for other names get 403")
    dash.add_argument("--port", type=int, default=8080, help="listen port (default 8080; 0: any)")

    report = _job_flags(sub.add_parser(
        "report", help="write a timeline of a job (world size, throughput, events)",
        description="A self-contained SVG (or an HTML page around it) of the current run: "
        "world size and throughput over time with every event marked. Works during and "
        "after a run, while its keys are in etcd (run_ttl_s after its last peer)."))
    report.add_argument("--out", required=True, type=Path, help="FILE.svg or FILE.html")
    return parser


def entry() -> None:
    """The ``peer-elastic`` console script: :func:`main`, then exit with its code; a
    :data:`one-shot <ONE_SHOT_COMMANDS>` command leaves without the interpreter's exit
    (logs and output flushed first)."""
    code = main(leave_at_once=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None, *, leave_at_once: bool = False) -> int:
    """Run one command; return its exit code. With ``leave_at_once`` (the console script),
    a one-shot command ends the process itself, right after its work."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code = _dispatch(args, parser)
    if leave_at_once and args.command in ONE_SHOT_COMMANDS:
        _leave_now(code)
    return code


def _leave_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written
            pass
    os._exit(code)


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "run":
            return cmd_run(args, parser)
        if args.command == "etcd":
            return cmd_etcd(args)
        if args.command == "status":
            return cmd_status(args, parser)
        if args.command == "drain":
            return cmd_drain(args, parser)
        if args.command == "events":
            return cmd_events(args, parser)
        if args.command == "snapshots":
            return cmd_snapshots(args, parser)
        if args.command in ("set", "pause", "resume"):
            return cmd_set(args, parser)
        if args.command == "dashboard":
            return cmd_dashboard(args, parser)
        if args.command == "report":
            return cmd_report(args, parser)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except EtcdUnavailable as exc:
        print(f"peer-elastic: {exc}", file=sys.stderr)
        return EXIT_ETCD
    except (ConfigError, EtcdError) as exc:
        print(f"peer-elastic: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PeerElasticError as exc:
        print(f"peer-elastic: {exc}", file=sys.stderr)
        return EXIT_FAILED
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


# --- run ----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("run: give the command to run after --, e.g. -- python train.py")
    if args.nproc < 1:
        parser.error("run: -n must be at least 1")
    if args.tee and args.log_dir is None:
        parser.error("run: --tee needs --log-dir")
    job = args.job or f"job-{os.getpid()}-{int(time.time())}"
    env = dict(os.environ)
    env[JOB.env] = job
    for f in JOB_FIELDS:
        value = getattr(args, f.name)
        if value is not None:
            env[f.env] = str(value)
    server = None
    if args.standalone:
        from peer_elastic.etcd_server import EtcdServer

        server = EtcdServer(die_with_parent=True).start()
        env[ETCD.env] = server.endpoint
        print(f"peer-elastic: embedded etcd at {server.endpoint}, job {job}", file=sys.stderr)
    else:
        env[ETCD.env] = args.etcd
    # If this launcher is SIGKILLed, its peers get a signal (peer_elastic.parent_death):
    # SIGTERM, to leave the job gracefully, as on Ctrl-C. With --standalone the job's etcd
    # ends with the launcher too, so nothing is left to leave (a peer would retry the gone
    # etcd for its whole retry budget): SIGKILL.
    orphaned = signal.SIGKILL if server is not None else signal.SIGTERM
    try:
        return _run_peers(cmd, args.nproc, env, OutputOptions(args.log_dir, args.tee),
                          orphaned)
    finally:
        if server is not None:
            server.stop()


def _start_tracker(env: dict[str, str]) -> RankTracker | None:
    """A watch of the job that tells each peer's current rank (None if etcd is not reachable:
    the output then carries the peer index alone)."""
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.etcd.registration import default_host
    from peer_elastic.ops.ranks import RankTracker

    try:
        client = client_from_env(env[ETCD.env], retry_budget_s=10.0)
        # The peers' host name as they report it: the same setting, read from their env.
        host = env.get(HOST.env) or default_host()
        return RankTracker(client, env[JOB.env], host).start()
    except (PeerElasticError, OSError) as exc:
        print(f"peer-elastic: ranks unknown ({exc}); lines carry the peer index",
              file=sys.stderr)
        return None


def _run_peers(cmd: list[str], n: int, env: dict[str, str], output: OutputOptions,
               orphaned: signal.Signals) -> int:
    procs: list[subprocess.Popen[Any]] = []
    stopping = {"signal": 0}
    tracker: RankTracker | None = None

    def track() -> None:
        nonlocal tracker
        started = _start_tracker(env)
        tracker = started
        # Peers started before the watch was up; those started after add themselves below
        # (a peer seen by both is added twice, which is harmless).
        if started is not None:
            for i, p in enumerate(list(procs)):
                started.add(i, p.pid)

    def label(index: int) -> str:
        t = tracker
        if t is None:
            return unknown_role(index)
        return t.label(index)

    def forward(signum: int, frame: Any) -> None:
        # Ctrl-C or SIGTERM: every peer leaves gracefully (SIGTERM is "leave" to a peer).
        stopping["signal"] = signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    # The watch starts beside the peers: an etcd slow to answer must not delay them.
    threading.Thread(target=track, name="rank-tracker", daemon=True).start()
    mux = Multiplexer(label, output, sys.stdout.buffer, sys.stderr.buffer)
    old_int = signal.signal(signal.SIGINT, forward)
    old_term = signal.signal(signal.SIGTERM, forward)
    # Nobody would read a peer's output once this process is gone, whatever ended it.
    on_launcher_death = die_with_parent(orphaned)
    try:
        for i in range(n):
            penv = dict(env, **{LOCAL_RANK.env: str(i)})
            p = subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=on_launcher_death)
            procs.append(p)
            if tracker is not None:
                tracker.add(i, p.pid)
            mux.attach(i, p.stdout, p.stderr)
        codes = [p.wait() for p in procs]
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        mux.close()
        if tracker is not None:
            tracker.stop()
            tracker.client.close()
    if stopping["signal"]:
        return EXIT_INTERRUPTED
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else EXIT_OK


# --- etcd ---------------------------------------------------------------------------------------


def cmd_etcd(args: argparse.Namespace) -> int:
    from peer_elastic.etcd_server import EtcdServer

    server = EtcdServer(data_dir=args.data_dir, client_port=args.port, log_file=None,
                        die_with_parent=True)
    server.start()
    # Ctrl-C and SIGTERM only set an event: a KeyboardInterrupt raised in the middle of
    # Popen.poll() can leave its internal wait lock held, and stop() then could not reap etcd.
    # Set off the handler (peer_elastic.signal_relay): a repeated Ctrl-C must not deadlock.
    # Relayed before the line that says it runs: whoever reads it may signal at once.
    stopping = threading.Event()
    with SignalRelay((signal.SIGINT, signal.SIGTERM), lambda _signum: stopping.set()):
        print(f"etcd running at {server.endpoint} (data in {args.data_dir}); Ctrl-C stops it",
              file=sys.stderr)
        try:
            while server.running and not stopping.wait(0.5):
                pass
        finally:
            server.stop()
    return EXIT_INTERRUPTED if stopping.is_set() else EXIT_OK


# --- status / drain -----------------------------------------------------------------------------


def _need(args: argparse.Namespace, parser: argparse.ArgumentParser, *names: str) -> None:
    for name in names:
        if not getattr(args, name):
            parser.error(f"{args.command}: --{name} is required (or set PEER_ELASTIC_{name.upper()})")


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.admin import job_status
    from peer_elastic.etcd.client import client_from_env

    _need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        doc = job_status(client, args.job)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"job {doc['job']} (run {doc['run_id']}): generation {doc['generation']}, "
          f"world size {doc['world_size']}, leader {doc['leader']}, resets {doc['resets']}")
    if doc["reason"]:
        print(f"  last change: {doc['reason']}")
    for m in doc["members"]:
        role = "standby" if m["standby"] else f"rank {m['rank']}"
        seen = "?" if m["last_seen_s"] is None else m["last_seen_s"]
        print(f"  {m['id']:<40} {m['host']:<20} {role:<9} age {m['age_s']} s, seen {seen} s ago"
              + (f"  at {m['net_address']}" if m["net_address"] else "")
              + (f"  metrics {m['address']}" if m["address"] else "")
              + ("  (draining)" if m["draining"] else "")
              + ("  (cut off from the others)" if m.get("cut_off") else "")
              + (f"  cannot reach {', '.join(m['unreachable'])}" if m.get("unreachable")
                 else ""))
    if doc["progress"]:
        p = doc["progress"]
        print(f"  progress: epoch {p['epoch']} batch {p['batch']} step {p['step']} "
              f"({p['age_s']} s ago)")
    if doc.get("snapshot"):
        s = doc["snapshot"]
        print(f"  newest snapshot: commit {s['commits']} epoch {s['epoch']} "
              f"({round(time.time() - s['unix'], 1)} s ago) at {s['host']}:{s['path']}")
    if doc["done"]:
        d = doc["done"]
        print("  done: " + ("success" if d["success"] else f"failed: {d['reason']}"))
    return EXIT_OK


def cmd_drain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.admin import drain, drain_all
    from peer_elastic.etcd.client import client_from_env

    _need(args, parser, "etcd", "job")
    if bool(args.all) == bool(args.member_id):
        parser.error("drain: give a member id or --all (not both)")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        if args.all:
            members = drain_all(client, args.job, requested_by="peer-elastic drain --all")
            print(f"asked all {len(members)} members of job {args.job} to leave")
            return EXIT_OK
        drain(client, args.job, args.member_id, requested_by="peer-elastic drain")
    print(f"asked {args.member_id} to leave job {args.job}")
    return EXIT_OK


def cmd_snapshots(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.admin import snapshot_document
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.etcd.snapshot_records import list_snapshots

    _need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        docs = [snapshot_document(r) for r in list_snapshots(client, args.job)]
    if args.json:
        print(json.dumps(docs, indent=2, sort_keys=True))
        return EXIT_OK
    if not docs:
        print(f"job {args.job}: no snapshots recorded")
    for d in docs:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["unix"]))
        print(f"{stamp}  commit {d['commits']:<8} epoch {d['epoch']:<5} "
              f"{d['bytes'] / 2**20:9.1f} MiB  {d['host']}:{d['path']}")
    return EXIT_OK


def _event_line(kv_value: bytes, key: str, as_json: bool) -> str | None:
    from peer_elastic.errors import RecordError
    from peer_elastic.records import EventRecord, GenerationCause, decode

    try:
        ev = decode(EventRecord, kv_value, key)
    except RecordError:
        return None
    if as_json:
        return json.dumps({"unix": ev.unix, "kind": ev.kind, "member": ev.member_id,
                           "generation": ev.generation, "detail": ev.detail,
                           "timings_s": dict(ev.timings_s),
                           # generation events of this version on: the new roster's size
                           # and its typed causes (0 and [] from an older writer)
                           "world_size": ev.world_size,
                           "causes": [GenerationCause.Name(c) if c in GenerationCause.values()
                                      else str(c) for c in ev.causes]}, sort_keys=True)
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.unix)) + f".{int(ev.unix % 1 * 1000):03d}"
    line = f"{stamp} gen {ev.generation:<4} {ev.kind:<18} {ev.member_id:<28} {ev.detail}"
    if ev.timings_s:
        order = ["detected_to_written", "written_to_formed", "formed_to_synced",
                 "synced_to_first_step", "total"]
        parts = [f"{k}={ev.timings_s[k] * 1000:.0f}ms" for k in order if k in ev.timings_s]
        line += "  [" + " ".join(parts) + "]"
    return line


def cmd_events(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.admin import current_run
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.etcd.keys import RunKeys
    from peer_elastic.etcd.watch import PrefixWatch

    _need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        run, _ = current_run(client, args.job)
        prefix = RunKeys(args.job, run.run_id).events_prefix

        def show(kvs: list[Any]) -> None:
            for kv in sorted(kvs, key=lambda kv: kv.key):
                line = _event_line(kv.value, kv.key, args.json)
                if line is not None:
                    print(line, flush=True)

        if not args.follow:
            kvs, _ = client.get_prefix(prefix)
            show(kvs)
            return EXIT_OK
        watch = PrefixWatch(client, prefix, lambda kvs, rev: show(kvs),
                            lambda evs, rev: show([e.kv for e in evs if e.kind == "put"]))
        watch.start()
        try:
            while True:
                time.sleep(0.5)
        finally:
            watch.stop()


def cmd_dashboard(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.ops.dashboard import Dashboard

    _need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        try:
            dash = Dashboard(client, args.job, args.host, args.port,
                             allowed_hosts=args.allow_host).start()
        except OSError as exc:
            print(f"peer-elastic: cannot serve on {args.host}:{args.port}: {exc}",
                  file=sys.stderr)
            return EXIT_FAILED
        # Signals only set an event (off the handler: peer_elastic.signal_relay): the
        # serving threads stop in an orderly way. Relayed before the line that says it
        # serves: whoever reads it may signal at once.
        stopping = threading.Event()
        with SignalRelay((signal.SIGINT, signal.SIGTERM), lambda _signum: stopping.set()):
            print(f"peer-elastic: dashboard of job {args.job} at {dash.url} (Ctrl-C stops it)",
                  file=sys.stderr, flush=True)
            try:
                stopping.wait()
            finally:
                dash.stop()
    return EXIT_INTERRUPTED


def cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.ops.report import write_report
    from peer_elastic.ops.timeline import read_timeline

    _need(args, parser, "etcd", "job")
    if args.out.suffix not in (".svg", ".html"):
        parser.error("report: --out must end in .svg or .html")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        timeline = read_timeline(client, args.job)
    write_report(timeline, args.job, args.out)
    print(f"wrote {args.out}: {len(timeline.generations)} generations, "
          f"{len(timeline.events)} events, {len(timeline.progress)} progress points")
    return EXIT_OK


def cmd_set(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from peer_elastic.etcd.admin import update_config
    from peer_elastic.etcd.client import client_from_env

    _need(args, parser, "etcd", "job")
    if args.command == "set":
        changes: dict[str, object] = {}
        for item in args.assignments:
            name, sep, value = item.partition("=")
            if not sep or not name:
                parser.error(f"set: expected NAME=VALUE, got {item!r}")
            changes[name.strip()] = value.strip()
    else:
        changes = {"paused": args.command == "pause"}
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        cfg = update_config(client, args.job, changes, requested_by="peer-elastic " + args.command)
    shown = ", ".join(f"{k}={getattr(cfg, k)}" for k in changes)
    print(f"job {args.job}: {shown}")
    return EXIT_OK


if __name__ == "__main__":
    entry()
