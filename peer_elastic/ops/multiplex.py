"""Whole, prefixed lines from many child processes on one terminal (and per-peer files).

``peer-elastic run`` starts N peers that all write to the same terminal. Left alone, their
writes interleave at arbitrary byte boundaries (``Loss: 0.26Train Epoch: 10 ...``). Here
each pipe is pumped by its own thread that reads whole lines and writes each one, with its
peer's prefix, in a single write under one lock: a line is never split or mixed with
another. Undecodable bytes are kept visible (backslash escapes), a last line without a
newline is still written (with one), and a line longer than :data:`MAX_LINE` is cut into
pieces that each carry the prefix, so one runaway writer cannot exhaust memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from peer_elastic.process import threads

#: Longest piece written as one line; longer lines are cut (each piece prefixed).
MAX_LINE = 1 << 20


def unknown_role(index: int) -> str:
    """The prefix of peer ``index`` while its rank is not known."""
    return f"[peer{index}]: "


@dataclass(frozen=True)
class OutputOptions:
    """Where peers' output goes: the terminal unless ``log_dir`` is set; both with ``tee``."""

    log_dir: Path | None = None
    tee: bool = False

    @property
    def to_terminal(self) -> bool:
        return self.log_dir is None or self.tee


class Multiplexer:
    """Pumps the stdout and stderr pipes of numbered peers into whole prefixed lines.

    ``label(index)`` is asked at every line (so a rank that changes over resets shows up on
    the next line); it must be quick and must not block.
    """

    def __init__(self, label: Callable[[int], str], options: OutputOptions,
                 stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._label = label
        self._options = options
        self._stdout = stdout
        self._stderr = stderr
        self._lock = threading.Lock()  # one lock for every destination: whole lines only
        self._files: dict[int, BinaryIO] = {}
        self._threads: list[threading.Thread] = []
        if options.log_dir is not None:
            options.log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, index: int) -> Path | None:
        """The file peer ``index`` writes to (None without a log directory)."""
        d = self._options.log_dir
        return None if d is None else d / f"peer-{index}.log"

    def attach(self, index: int, stdout: BinaryIO | None, stderr: BinaryIO | None) -> None:
        """Start pumping peer ``index``'s pipes (either may be None: not captured)."""
        path = self.log_path(index)
        if path is not None:
            self._files[index] = open(path, "ab")  # noqa: SIM115 (closed in close())
        for pipe, terminal in ((stdout, self._stdout), (stderr, self._stderr)):
            if pipe is None:
                continue
            self._threads.append(threads.start(self._pump, f"peer-{index}-output",
                                               args=(index, pipe, terminal)))

    def _pump(self, index: int, pipe: BinaryIO, terminal: BinaryIO) -> None:
        try:
            while True:
                chunk = pipe.readline(MAX_LINE)
                if not chunk:
                    return
                self.write_line(index, chunk, terminal)
        except (OSError, ValueError):  # pipe closed under us: the peer is gone
            return
        finally:
            pipe.close()

    def write_line(self, index: int, raw: bytes, terminal: BinaryIO) -> None:
        """Write one line of peer ``index`` (``raw``, with or without its newline)."""
        text = raw.rstrip(b"\n").removesuffix(b"\r").decode("utf-8", "backslashreplace")
        line = f"{self._label(index)}{text}\n".encode("utf-8", "backslashreplace")
        with self._lock:
            if self._options.to_terminal:
                try:
                    terminal.write(line)
                    terminal.flush()
                except (OSError, ValueError):
                    pass  # a closed terminal must not stop the peers' log files
            f = self._files.get(index)
            if f is not None:
                f.write(line)
                f.flush()

    def close(self, timeout: float = 10.0) -> None:
        """Wait until every pipe is drained (``timeout`` in all: a peer's child that kept the
        pipe open must not hold up the launcher), then close the log files."""
        threads.join_all(self._threads, timeout)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
