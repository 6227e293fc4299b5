"""``peer-elastic run``: start N identical local peers of one job and report the job's result.

What a peer finds in its environment (:func:`peer_environment`): the job's name, etcd and
settings as ``PEER_ELASTIC_*`` variables, the log level when one was asked for, and the
variables torchrun sets, with their *launch* values (peer i of n on this host), so that a
script written for torchrun runs unchanged. peer-elastic forms its own groups, and a peer's
rank changes over resets: ``peer.rank`` is the truth; ``LOCAL_RANK`` stays right for the
process's whole life (it picks the device).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from peer_elastic.cli.etcd import start_etcd
from peer_elastic.cli.exit_codes import CommandFailed, ExitCode
from peer_elastic.cli.parser import chosen_log_level
from peer_elastic.config import JOB_FIELDS
from peer_elastic.errors import PeerElasticError
from peer_elastic.ops.multiplex import Multiplexer, OutputOptions, unknown_role
from peer_elastic.process import threads
from peer_elastic.process.parent_death import die_with_parent
from peer_elastic.settings_table import ETCD, HOST, JOB, LOCAL_RANK, LOG_LEVEL
from peer_elastic.straggler.policy import EXIT_STRAGGLER

if TYPE_CHECKING:  # imported where used: the etcd client is slow to import
    from peer_elastic.etcd_server import EtcdServer
    from peer_elastic.ops.ranks import RankTracker

__all__ = ["TORCHRUN_VARIABLES", "RunOutcome", "cmd_run", "peer_environment", "run_outcome"]

#: The variables torchrun gives each worker, which ``run`` sets too (launch values).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")
#: MASTER_ADDR: the peers of one ``run`` share this host.
LAUNCH_HOST = "127.0.0.1"


@dataclass(frozen=True)
class JobTarget:
    """Where the peers meet: an etcd to start (``standalone``) or ``etcd``; and the job."""

    job: str
    etcd: str | None
    standalone: bool


def job_target(args: argparse.Namespace, parser: argparse.ArgumentParser,
               environ: Mapping[str, str]) -> JobTarget:
    """The flags, else the exported ``PEER_ELASTIC_JOB`` / ``PEER_ELASTIC_ETCD``, as every
    other subcommand reads them: two hosts that export the same job form one job."""
    job = args.job or JOB.raw(environ) or f"job-{os.getpid()}-{int(time.time())}"
    if args.standalone:
        return JobTarget(job, None, True)
    etcd = args.etcd or ETCD.raw(environ)
    if not etcd:
        parser.error(f"run: give --etcd HOST:PORT (or set {ETCD.env}), or --standalone for an "
                     "embedded etcd")
    return JobTarget(job, etcd, False)


def peer_environment(base: Mapping[str, str], index: int, count: int,
                     master_port: int) -> dict[str, str]:
    """The environment of peer ``index`` of ``count``: ``base`` (the job's variables already
    in it) plus its local rank and the torchrun-style launch values."""
    launch = dict(zip(TORCHRUN_VARIABLES, (
        str(index), str(index), str(count), str(count), LAUNCH_HOST, str(master_port)),
        strict=True))
    return {**base, LOCAL_RANK.env: str(index), **launch}


@dataclass(frozen=True)
class RunOutcome:
    """``run``'s exit code and, for the user, a line per peer that did not exit 0."""

    code: ExitCode
    notes: tuple[str, ...] = ()


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_outcome(returncodes: Sequence[int], interrupted: bool) -> RunOutcome:
    """The job's result from its peers' exit codes (``subprocess``'s: negative for a signal).

    A peer that exits by itself speaks for the job: 0 once it completed, ``JOB_FAILED`` when
    it failed as a whole. A peer killed by a signal, or evicted as a straggler
    (``EXIT_STRAGGLER``: it left gracefully), is a loss the job survives (the others
    re-form and go on), so it does not fail the run, unless no peer finished at all.
    """
    notes = []
    for i, rc in enumerate(returncodes):
        if rc < 0:
            notes.append(f"peer {i} was killed by {_signal_name(rc)}")
        elif rc == EXIT_STRAGGLER:
            notes.append(f"peer {i} was evicted as a straggler (exit code {rc})")
        elif rc != 0:
            notes.append(f"peer {i} exited with code {rc}")
    finished = [rc for rc in returncodes if rc >= 0 and rc != EXIT_STRAGGLER]
    if interrupted:
        code = ExitCode.INTERRUPTED
    elif ExitCode.JOB_FAILED in finished:
        code = ExitCode.JOB_FAILED
    elif not finished:
        code = ExitCode.FAILED
        notes.append("no peer finished")
    elif any(rc != 0 for rc in finished):
        code = ExitCode.FAILED
    else:
        code = ExitCode.OK
        if notes:
            notes.append("the job completed without them")
    return RunOutcome(code, tuple(notes))


def _job_environment(args: argparse.Namespace, job: str,
                     environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the job's name, the settings given as flags and the log level asked
    for: what every peer of this run shares (the etcd comes once it is known)."""
    env = {**environ, JOB.env: job}
    for f in JOB_FIELDS:
        value = getattr(args, f.name)
        if value is not None:
            env[f.env] = str(value)
    level = chosen_log_level(args)
    if level is not None:
        env[LOG_LEVEL.env] = level
    return env


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    from peer_elastic.etcd_server import free_port

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("run: give the command to run after --, e.g. -- python train.py")
    if args.nproc < 1:
        parser.error("run: -n must be at least 1")
    if args.tee and args.log_dir is None:
        parser.error("run: --tee needs --log-dir")
    target = job_target(args, parser, os.environ)
    env = _job_environment(args, target.job, os.environ)
    server: EtcdServer | None = None
    if target.standalone:
        server = start_etcd(alternative="pass --etcd HOST:PORT of a running etcd",
                            die_with_parent=True)
        env[ETCD.env] = server.endpoint
    else:
        assert target.etcd is not None
        env[ETCD.env] = target.etcd
    embedded = " (embedded)" if server is not None else ""
    print(f"peer-elastic: job {target.job} on etcd {env[ETCD.env]}{embedded}; see it with: "
          f"peer-elastic status --etcd {env[ETCD.env]} --job {target.job}",
          file=sys.stderr, flush=True)
    # If this launcher is SIGKILLed, its peers get a signal (peer_elastic.process.parent_death):
    # SIGTERM, to leave the job gracefully, as on Ctrl-C. With --standalone the job's etcd
    # ends with the launcher too, so nothing is left to leave (a peer would retry the gone
    # etcd for its whole retry budget): SIGKILL.
    orphaned = signal.SIGKILL if server is not None else signal.SIGTERM
    master_port = free_port()  # free now; only a torchrun-style script of the user's binds it
    envs = [peer_environment(env, i, args.nproc, master_port) for i in range(args.nproc)]
    try:
        outcome = _run_peers(cmd, envs, OutputOptions(args.log_dir, args.tee), orphaned)
    finally:
        if server is not None:
            server.stop()
    for note in outcome.notes:
        print(f"peer-elastic: {note}", file=sys.stderr, flush=True)
    return outcome.code


def _start_tracker(env: Mapping[str, str]) -> RankTracker | None:
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


def _run_peers(cmd: list[str], envs: Sequence[Mapping[str, str]], output: OutputOptions,
               orphaned: signal.Signals) -> RunOutcome:
    procs: list[subprocess.Popen[Any]] = []
    stopping = {"signal": 0}
    tracker: RankTracker | None = None

    def track() -> None:
        nonlocal tracker
        started = _start_tracker(envs[0])
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
    threads.start(track, "rank-tracker")
    mux = Multiplexer(label, output, sys.stdout.buffer, sys.stderr.buffer)
    old_int = signal.signal(signal.SIGINT, forward)
    old_term = signal.signal(signal.SIGTERM, forward)
    # Nobody would read a peer's output once this process is gone, whatever ended it.
    on_launcher_death = die_with_parent(orphaned)
    try:
        for i, penv in enumerate(envs):
            try:
                p = subprocess.Popen(cmd, env=dict(penv), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, preexec_fn=on_launcher_death)
            except OSError as exc:  # no such program, not executable: the same for every peer
                raise CommandFailed(ExitCode.USAGE, f"run: cannot start {cmd[0]!r}: "
                                    f"{exc.strerror or exc}; check the command after --"
                                    ) from None
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
    return run_outcome(codes, interrupted=bool(stopping["signal"]))
