"""The subcommands that talk to a job in etcd: status, drain, events, snapshots, set,
pause, resume, dashboard, report. They parse nothing (:mod:`peer_elastic.cli.parser`) and
decide nothing (:mod:`peer_elastic.etcd.admin`): they ask and print."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from peer_elastic.cli.exit_codes import CommandFailed, ExitCode
from peer_elastic.cli.stopping import StopSignals

__all__ = ["cmd_dashboard", "cmd_drain", "cmd_events", "cmd_report", "cmd_set",
           "cmd_snapshots", "cmd_status"]


def need(args: argparse.Namespace, parser: argparse.ArgumentParser, *names: str) -> None:
    """Exit 2 (argparse's usage error) naming the first of ``names`` left unset."""
    for name in names:
        if not getattr(args, name):
            parser.error(f"{args.command}: --{name} is required (or set PEER_ELASTIC_{name.upper()})")


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.admin import job_status
    from peer_elastic.etcd.client import client_from_env

    need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        doc = job_status(client, args.job)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return ExitCode.OK
    print(f"job {doc['job']} (run {doc['run_id']}): generation {doc['generation']}, "
          f"world size {doc['world_size']}, leader {doc['leader']}, resets {doc['resets']}")
    if doc["reason"]:
        print(f"  last change: {doc['reason']}")
    for m in doc["members"]:
        role = "standby" if m["standby"] else f"rank {m['rank']}"
        seen = "?" if m["last_seen_s"] is None else m["last_seen_s"]
        print(f"  {m['id']:<40} {m['host']:<20} {role:<9} age {m['age_s']} s, seen {seen} s ago"
              + (f"  straggler score {m['straggler_score']:.2f}"
                 if m.get("straggler_score") is not None else "")
              + (f"  at {m['net_address']}" if m["net_address"] else "")
              + (f"  metrics {m['address']}" if m["address"] else "")
              + ("  (draining)" if m["draining"] else "")
              + ("  (cut off from the others)" if m.get("cut_off") else "")
              + (f"  cannot reach {', '.join(m['unreachable'])}" if m.get("unreachable")
                 else ""))
    if doc.get("pace"):
        pace = doc["pace"]
        print(f"  pace: {pace['step_s'] * 1000:.1f} ms a step in generation "
              f"{pace['generation']} ({pace['age_s']} s ago); a score is a peer's own time "
              f"over the others' median, {doc['config']['straggler_threshold']} or more is slow")
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
    return ExitCode.OK


def cmd_drain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.admin import drain, drain_all
    from peer_elastic.etcd.client import client_from_env

    need(args, parser, "etcd", "job")
    if bool(args.all) == bool(args.member_id):
        parser.error("drain: give a member id or --all (not both)")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        if args.all:
            members = drain_all(client, args.job, requested_by="peer-elastic drain --all")
            print(f"asked all {len(members)} members of job {args.job} to leave")
            return ExitCode.OK
        drain(client, args.job, args.member_id, requested_by="peer-elastic drain")
    print(f"asked {args.member_id} to leave job {args.job}")
    return ExitCode.OK


def cmd_snapshots(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.admin import snapshot_document
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.etcd.snapshot_records import list_snapshots

    need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        docs = [snapshot_document(r) for r in list_snapshots(client, args.job)]
    if args.json:
        print(json.dumps(docs, indent=2, sort_keys=True))
        return ExitCode.OK
    if not docs:
        print(f"job {args.job}: no snapshots recorded")
    for d in docs:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["unix"]))
        print(f"{stamp}  commit {d['commits']:<8} epoch {d['epoch']:<5} "
              f"{d['bytes'] / 2**20:9.1f} MiB  {d['host']}:{d['path']}")
    return ExitCode.OK


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
                                      else str(c) for c in ev.causes],
                           # straggler events: the member's host and its score ("" and 0
                           # for other events)
                           "host": ev.host, "score": ev.score}, sort_keys=True)
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.unix)) + f".{int(ev.unix % 1 * 1000):03d}"
    line = f"{stamp} gen {ev.generation:<4} {ev.kind:<18} {ev.member_id:<28} {ev.detail}"
    if ev.timings_s:
        order = ["detected_to_written", "written_to_formed", "formed_to_synced",
                 "synced_to_first_step", "total"]
        parts = [f"{k}={ev.timings_s[k] * 1000:.0f}ms" for k in order if k in ev.timings_s]
        line += "  [" + " ".join(parts) + "]"
    return line


def cmd_events(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.admin import current_run
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.etcd.keys import RunKeys
    from peer_elastic.etcd.watch import PrefixWatch

    need(args, parser, "etcd", "job")
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
            return ExitCode.OK
        watch = PrefixWatch(client, prefix, lambda kvs, rev: show(kvs),
                            lambda evs, rev: show([e.kv for e in evs if e.kind == "put"]))
        watch.start()
        try:
            with StopSignals() as stop:
                stop.wait()
            return stop.exit_code
        finally:
            watch.stop()


def cmd_dashboard(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.ops.dashboard import Dashboard

    need(args, parser, "etcd", "job")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        try:
            dash = Dashboard(client, args.job, args.host, args.port,
                             allowed_hosts=args.allow_host).start()
        except OSError as exc:
            raise CommandFailed(ExitCode.FAILED, f"cannot serve on {args.host}:{args.port}: "
                                f"{exc.strerror or exc}; choose another --port or --host") from None
        # Relayed before the line that says it serves: whoever reads it may signal at once.
        with StopSignals() as stop:
            print(f"peer-elastic: dashboard of job {args.job} at {dash.url} (Ctrl-C stops it)",
                  file=sys.stderr, flush=True)
            try:
                stop.wait()
            finally:
                dash.stop()
    return stop.exit_code


def cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.client import client_from_env
    from peer_elastic.ops.report import write_report
    from peer_elastic.ops.timeline import read_timeline

    need(args, parser, "etcd", "job")
    if args.out.suffix not in (".svg", ".html"):
        parser.error("report: --out must end in .svg or .html")
    folder = args.out.parent
    if not folder.is_dir():  # found before etcd is asked anything
        raise CommandFailed(ExitCode.USAGE, f"report: the directory of --out, {folder}, does "
                            f"not exist; create it (mkdir -p {folder}) or choose another --out")
    with client_from_env(args.etcd, retry_budget_s=args.timeout) as client:
        timeline = read_timeline(client, args.job)
    try:
        write_report(timeline, args.job, args.out)
    except OSError as exc:
        raise CommandFailed(ExitCode.FAILED, f"report: cannot write {args.out}: "
                            f"{exc.strerror or exc}; choose another --out") from None
    print(f"wrote {args.out}: {len(timeline.generations)} generations, "
          f"{len(timeline.events)} events, {len(timeline.progress)} progress points")
    return ExitCode.OK


def cmd_set(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd.admin import update_config
    from peer_elastic.etcd.client import client_from_env

    need(args, parser, "etcd", "job")
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
    return ExitCode.OK
