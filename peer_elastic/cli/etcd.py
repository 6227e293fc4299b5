"""``peer-elastic etcd``, and the one line a user reads when an etcd cannot be started
(here and in ``run --standalone``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from peer_elastic.cli.exit_codes import CommandFailed, ExitCode
from peer_elastic.cli.stopping import StopSignals

if TYPE_CHECKING:  # imported where used: the CLI starts quicker without it
    from peer_elastic.etcd_server import EtcdServer

__all__ = ["cmd_etcd", "start_etcd"]


def start_etcd(*, alternative: str = "", port_fix: str = "", **kwargs: object) -> EtcdServer:
    """An :class:`~peer_elastic.etcd_server.EtcdServer` built with ``kwargs`` and started,
    or :class:`CommandFailed` (exit 1) with one line that says why and what to do.
    ``alternative``: another way out when there is no etcd binary; ``port_fix``: what to do
    when a port it was given is taken."""
    from peer_elastic.etcd_server import INSTALL_HINT, EtcdNotFound, EtcdServer, EtcdStartError

    try:
        server = EtcdServer(**kwargs)  # type: ignore[arg-type]
    except EtcdNotFound as exc:
        if exc.override:
            raise CommandFailed(ExitCode.FAILED, f"{exc}; point it at an etcd binary or unset "
                                "it") from None
        raise CommandFailed(ExitCode.FAILED, f"no etcd binary found: {INSTALL_HINT}"
                            + (f", or {alternative}" if alternative else "")) from None
    try:
        return server.start()
    except EtcdStartError as exc:
        server.stop()  # its log goes with it: the cause below is what it said
        why = f": {exc.cause}" if exc.cause else ""
        fix = f"; {port_fix}" if exc.port_taken and port_fix else ""
        raise CommandFailed(ExitCode.FAILED, f"etcd did not start ({exc.summary}){why}{fix}"
                            ) from None


def cmd_etcd(args: argparse.Namespace) -> ExitCode:
    server = start_etcd(port_fix="choose another --port", data_dir=args.data_dir,
                        client_port=args.port, log_file=None, die_with_parent=True)
    # Ctrl-C and SIGTERM only set an event: a KeyboardInterrupt raised in the middle of
    # Popen.poll() can leave its internal wait lock held, and stop() then could not reap etcd.
    # Relayed before the line that says it runs: whoever reads it may signal at once.
    with StopSignals() as stop:
        print(f"etcd running at {server.endpoint} (data in {args.data_dir}); Ctrl-C stops it",
              file=sys.stderr, flush=True)
        try:
            while server.running and not stop.wait(0.5):
                pass
        finally:
            server.stop()
    if not stop.wait(0):
        raise CommandFailed(ExitCode.FAILED, f"etcd at {server.endpoint} exited by itself")
    return stop.exit_code
