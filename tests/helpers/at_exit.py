"""What a test worker says about itself when a test asks, and when its process exits.

Imported by the test workers (elastic_worker, vote_worker), not by the harness.
"""

from __future__ import annotations

import atexit
import faulthandler
import signal
import threading

from peer_elastic.process import threads

#: Starts the line a worker prints at exit when threads besides its main one still run:
#: ``THREADS-AT-EXIT ours=[...] others=[...]`` (ours: started by peer-elastic; others: by
#: the libraries, such as gRPC's). None of ours may be left after join()
#: (peer_elastic.process.threads): procs.assert_no_thread_of_ours_left checks.
PREFIX = "THREADS-AT-EXIT"


def install() -> None:
    """``SIGUSR1`` writes every thread's stack (a test that gives up waiting for this peer
    asks, procs.PeerProc.dump_stacks); the exit prints :data:`PREFIX`'s line if due."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Registered after peer_elastic's own hooks (imported before), so it runs before them:
    # what it sees is what join() left, not what those hooks waited for.
    atexit.register(_report)


def _report() -> None:
    ours = sorted(t.name for t in threads.running())
    others = sorted(t.name for t in threading.enumerate()
                    if t is not threading.main_thread() and t.name not in ours)
    if ours or others:
        print(f"{PREFIX} ours={ours} others={others}", flush=True)
