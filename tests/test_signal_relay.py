"""SignalRelay on real signals sent to this process (pytest runs tests in the main thread,
where Python runs signal handlers). The real peers' SIGTERM burst is in test_elastic.py."""

from __future__ import annotations

import os
import select
import signal
import threading

import pytest

from peer_elastic.process.signal_relay import SignalRelay

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def test_a_burst_of_signals_acts_on_the_relay_thread_while_the_main_thread_holds_a_lock(
) -> None:
    # The old handlers took locks themselves; nested in one another by a burst, one waited
    # for a lock its own outer run held. Here the main thread even holds the lock the
    # action takes while the signals come: the handler takes none, so nothing waits.
    lock = threading.Lock()
    seen: list[tuple[int, str]] = []
    acted = threading.Event()

    def action(signum: int) -> None:
        with lock:
            seen.append((signum, threading.current_thread().name))
        acted.set()

    before = signal.getsignal(signal.SIGUSR1)
    relay = SignalRelay((signal.SIGUSR1, signal.SIGUSR2), action, name="test-relay").install()
    try:
        with lock:
            for i in range(500):
                os.kill(os.getpid(), signal.SIGUSR1 if i % 2 else signal.SIGUSR2)
        assert acted.wait(30)
    finally:
        relay.uninstall()
    assert relay.thread is not None
    relay.thread.join(30)
    assert not relay.thread.is_alive()  # it ends once uninstalled
    assert seen and {name for _, name in seen} == {"test-relay"}
    assert {signum for signum, _ in seen} <= {signal.SIGUSR1, signal.SIGUSR2}
    assert len(seen) < 500  # a burst of one signal acts once per read, not once per signal
    # They came: from now on they are ignored, so that a late one of the burst cannot kill
    # the process on its way out (the default for SIGUSR1 is to terminate).
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, before)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_a_failing_action_is_logged_and_the_next_signal_still_acts(caplog) -> None:
    calls: list[int] = []
    first, second = threading.Event(), threading.Event()

    def action(signum: int) -> None:
        calls.append(signum)
        if len(calls) == 1:
            first.set()
            raise RuntimeError("first one fails")
        second.set()

    with SignalRelay((signal.SIGUSR1,), action):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert first.wait(30)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert second.wait(30)
    assert "handling signal" in caplog.text and "first one fails" in caplog.text


def test_uninstall_puts_back_the_handler_of_a_signal_that_never_came() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    relay = SignalRelay((signal.SIGUSR2,), lambda signum: None).install()
    assert signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)
    relay.uninstall()
    relay.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_a_forked_child_gets_the_handler_from_before_and_its_signal_stays_its_own() -> None:
    # A DataLoader worker is forked from the training process while join()'s relay is
    # installed. Its SIGTERM (the DataLoader's terminate()) must end the worker, not reach
    # the peer's relay through the inherited pipe (the peer left the job, the worker lived).
    seen: list[int] = []
    usr2 = threading.Event()

    def action(signum: int) -> None:
        seen.append(signum)
        if signum == signal.SIGUSR2:
            usr2.set()

    # What the child must get back (an earlier relay here may have left SIG_IGN).
    outer = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    relay = SignalRelay((signal.SIGUSR1, signal.SIGUSR2), action, name="test-relay").install()
    try:
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: say it runs (the fork hooks ran before), then wait
            try:
                os.write(ready_w, b"x")
                signal.pause()
            finally:
                os._exit(3)  # only if the signal did not end it
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"x"
        os.close(ready_r)
        os.kill(pid, signal.SIGUSR1)
        pidfd = os.pidfd_open(pid)
        try:
            if not select.select([pidfd], [], [], 30)[0]:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError("the child lived on after SIGUSR1")
        finally:
            os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1
        # The pipe is first in, first out: had the child written SIGUSR1 into it, the relay
        # would have read that before this.
        os.kill(os.getpid(), signal.SIGUSR2)
        assert usr2.wait(30)
    finally:
        relay.uninstall()
        signal.signal(signal.SIGUSR1, outer)
    assert seen == [signal.SIGUSR2]
