"""The ``peer-elastic`` command.

Every expected failure is one line on stderr naming the fix, and an exit code of
:class:`~peer_elastic.cli.exit_codes.ExitCode` (the table is in docs/cli.md, checked against
the enum). ``run`` returns the job's result (:func:`~peer_elastic.cli.run.run_outcome`).

The pieces: :mod:`~peer_elastic.cli.parser` (flags and help), :mod:`~peer_elastic.cli.run`,
:mod:`~peer_elastic.cli.etcd`, :mod:`~peer_elastic.cli.jobs` (the commands on a job), and
:mod:`~peer_elastic.cli.stopping` (what SIGTERM and Ctrl-C mean to a server).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from peer_elastic.cli.exit_codes import CommandFailed, ExitCode
from peer_elastic.cli.parser import build_parser, chosen_log_level
from peer_elastic.errors import (
    ConfigError,
    EtcdError,
    EtcdUnavailable,
    JobNotFound,
    PeerElasticError,
)
from peer_elastic.settings_table import LOG_LEVEL

__all__ = ["ONE_SHOT_COMMANDS", "ExitCode", "build_parser", "entry", "main"]

#: Commands that only talk to etcd and print. Nothing of theirs needs the interpreter's
#: orderly exit (no child process, no server, no etcd of their own), and that exit can
#: hang after their work is done: a ``status`` that had printed its answer and returned did
#: not exit for 60 s, twice in the suite (a job whose run appeared meanwhile). So the
#: console script ends them at once, with everything written out (:func:`entry`).
ONE_SHOT_COMMANDS = frozenset({"status", "drain", "events", "snapshots", "set", "pause",
                               "resume", "report"})


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
    code = int(dispatch(args, parser))
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


def _setup_logging(args: argparse.Namespace) -> None:
    level = chosen_log_level(args) or (LOG_LEVEL.raw() or LOG_LEVEL.default).upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(code: ExitCode, message: object) -> ExitCode:
    print(f"peer-elastic: {message}", file=sys.stderr, flush=True)
    return code


def dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    """Run the command ``args`` names; an expected failure becomes one line and its code."""
    _setup_logging(args)
    try:
        return _command(args, parser)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except CommandFailed as exc:
        return _fail(exc.code, exc)
    except EtcdUnavailable as exc:
        return _fail(ExitCode.ETCD_UNREACHABLE, exc)
    except JobNotFound as exc:
        return _fail(ExitCode.NO_SUCH_JOB, f"{exc}; peer-elastic status --job NAME needs the "
                     "name a running job was started with")
    except (ConfigError, EtcdError) as exc:
        return _fail(ExitCode.USAGE, exc)
    except PeerElasticError as exc:
        return _fail(ExitCode.FAILED, exc)


def _command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    # Imported per command: `peer-elastic status` must not pay for what `run` needs.
    if args.command == "run":
        from peer_elastic.cli.run import cmd_run

        return cmd_run(args, parser)
    if args.command == "etcd":
        from peer_elastic.cli.etcd import cmd_etcd

        return cmd_etcd(args)
    from peer_elastic.cli import jobs

    commands = {"status": jobs.cmd_status, "drain": jobs.cmd_drain, "events": jobs.cmd_events,
                "snapshots": jobs.cmd_snapshots, "set": jobs.cmd_set, "pause": jobs.cmd_set,
                "resume": jobs.cmd_set, "dashboard": jobs.cmd_dashboard,
                "report": jobs.cmd_report}
    if args.command not in commands:
        parser.error(f"unknown command {args.command}")
    return commands[args.command](args, parser)
