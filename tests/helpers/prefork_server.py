"""A process that has imported torch and forks test peers from there, on request.

Importing torch costs a peer process well over a second of CPU, and the suite starts
hundreds of them. This server imports it once; every peer it starts is a fork of it that
then runs its module as ``python -m`` would: a process of its own (its own pid, session and
process group, stdin from /dev/null, stdout and stderr on the pipe it was handed), with the
environment, working directory and arguments asked for, and that exits the way a program
does (the interpreter's own exit: atexit handlers, threads joined, modules torn down). It
holds no state of gRPC or gloo (neither is imported here: peer_elastic is imported by the
peer) and no descriptor of the server.

What Python and the libraries read from the environment when they start (PYTHON*,
OMP_NUM_THREADS, ...) was read by the server: the client (tests/helpers/prefork.py) keeps
one server for each such environment, so only the variables a peer reads later differ.

A peer may be asked to run elsewhere on this machine (``place``: a network namespace, a
test "host"): it moves there itself, before its module runs (tests/helpers/place.py).

Protocol, on a Unix ``SOCK_SEQPACKET`` socket: a client connects and sends one request (JSON:
``module``, ``args``, ``env``, ``cwd``, ``place``) with the descriptor for the peer's output
attached; the server answers ``<pid>`` once it forked, and the peer's exit code
(``-<signal>`` when a signal ended it) once it exited; the client then answers, or closes,
and only then is the peer reaped. The server ends when its stdin closes (its client is gone)
and every peer it started has exited. It listens in a directory of its own, which it removes
then; ``READY <socket path>`` on its stdout says it listens.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import socket
import sys
import tempfile
from dataclasses import dataclass

from tests.helpers.place import Place

#: What the server imports before it forks (not peer_elastic: that imports gRPC).
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data")
MAX_REQUEST = 1 << 20


@dataclass(frozen=True)
class Request:
    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    output_fd: int
    place: Place | None  # where it runs (a network namespace, a host), else here


def serve(sock_path: str) -> Request | None:
    """Fork a peer for each request. Returns the request in a forked child (which then
    becomes the peer), None in the server when it is done."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, ("stdin",))
    sel.register(listener, selectors.EVENT_READ, ("listener",))
    peers: dict[int, socket.socket] = {}  # pidfd of each peer not reaped yet -> its client
    open_for_requests = True
    print("READY", sock_path, flush=True)
    while open_for_requests or peers:
        for key, _ in sel.select():
            what = key.data[0]
            if what == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the client closed it: no more requests
                    sel.unregister(key.fileobj)
                    sel.unregister(listener)
                    listener.close()
                    open_for_requests = False
            elif what == "listener":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, ("request",))
            elif what == "request":
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                sel.unregister(conn)
                msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 1)
                if not msg or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                fields = json.loads(msg)
                pid = os.fork()
                if pid == 0:
                    # The peer: nothing of the server's stays open in it.
                    for k in list(sel.get_map().values()):
                        if isinstance(k.fileobj, socket.socket):
                            k.fileobj.close()
                    sel.close()
                    for pidfd, c in peers.items():
                        os.close(pidfd)
                        c.close()
                    conn.close()
                    if open_for_requests:
                        listener.close()
                    place = fields.get("place")
                    return Request(fields["module"], fields["args"], fields["env"],
                                   fields["cwd"], fds[0], None if place is None else Place(**place))
                os.close(fds[0])
                pidfd = os.pidfd_open(pid)
                peers[pidfd] = conn
                sel.register(pidfd, selectors.EVENT_READ, ("exited",))
                conn.sendall(str(pid).encode())
            elif what == "exited":
                # Tell the client, but leave the peer a zombie until the client has read it
                # (as a child of its own would be): its pid is not reused while the test may
                # still signal it.
                pidfd = key.fd
                sel.unregister(pidfd)
                info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                conn = peers[pidfd]
                try:
                    conn.sendall(str(code).encode())
                    sel.register(conn, selectors.EVENT_READ, ("read", pidfd))
                except OSError:  # the client is gone
                    _reap(pidfd, peers)
            elif what == "read":  # the client read the exit (or went away): reap the peer
                sel.unregister(key.fileobj)
                _reap(key.data[1], peers)
    return None


def _reap(pidfd: int, peers: dict[int, socket.socket]) -> None:
    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    os.close(pidfd)
    peers.pop(pidfd).close()


def become(req: Request) -> None:
    """Turn this forked child into the peer ``python -m <module> <args>`` would have started
    with ``req.env`` and ``req.cwd``, and run it (returns when its module returns)."""
    os.setsid()  # its own session and process group, as start_new_session gives
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(req.output_fd, 1)
    os.dup2(req.output_fd, 2)
    os.close(req.output_fd)
    if req.place is not None:  # where `ip netns exec` would have started it
        req.place.enter()
    os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    sys.path[0] = os.getcwd()  # where ``python -m`` looks first
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process seeds numpy's global generator afresh
        numpy.random.seed()
    sys.argv = ["-m", *req.args]  # runpy puts the module's path in argv[0]
    runpy.run_module(req.module, run_name="__main__", alter_sys=True)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    where = tempfile.mkdtemp(prefix="peer-elastic-prefork-")
    sock_path = os.path.join(where, "s")
    req = serve(sock_path)
    if req is None:  # the server, done
        os.unlink(sock_path)
        os.rmdir(where)
        return
    become(req)


if __name__ == "__main__":
    main()
