"""What test workers print (tests/helpers/elastic_worker.py), read back from a :class:`PeerProc`.

The worker prints, each line whole and flushed:

- ``GEN <generation> <rank> <size>`` after each (re)formation,
- ``START <epoch> <processed> <commits>`` when training starts in it,
- ``STEP <epoch> <batch> <generation>`` every few batches,
- ``CALLBACK <generation> <digest>`` in its reset callback,
- ``RESULT <json>`` at the end, on rank 0.

and its log says ``joined job <job> run <run> as <member> (lease <hex>)`` when it registers.
Every wait here is bounded and wakes on the peer's new lines (never a fixed sleep).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tests.helpers.procs import PeerProc

T = TypeVar("T")

# Whole lines only: a result line another write broke into is skipped, never misread.
GEN_LINE = re.compile(r"GEN (\d+) (\d+) (\d+)")
STEP_LINE = re.compile(r"STEP (\d+) (\d+) (\d+)")
START_LINE = re.compile(r"START (\d+) (\d+) (\d+)")
JOINED = re.compile(r"joined job \S+ run \S+ as (\S+) \(lease ([0-9a-f]+)\)")


# -- parsing what a peer printed so far -------------------------------------------------------


def gens(p: PeerProc, after: int = 0) -> list[tuple[int, int, int, int]]:
    """(line index, generation, rank, size) of every GEN line at index >= ``after``."""
    with p.cond:
        return [(i, *map(int, m.groups())) for i, line in enumerate(p.lines)
                if i >= after and (m := GEN_LINE.fullmatch(line))]


def gen_lines(p: PeerProc) -> list[tuple[int, int, int]]:
    """(generation, rank, size) of every GEN line."""
    return [(g, r, size) for _, g, r, size in gens(p)]


def steps(p: PeerProc, generation: int | None = None) -> int:
    """How many STEP lines ``p`` printed (in ``generation``, if given)."""
    with p.cond:
        return sum(1 for line in p.lines if (m := STEP_LINE.fullmatch(line))
                   and (generation is None or int(m.group(3)) == generation))


def starts(p: PeerProc) -> list[tuple[int, int, int]]:
    """(epoch, samples processed, commits) of every START line."""
    with p.cond:
        return [(int(m[1]), int(m[2]), int(m[3])) for line in p.lines
                if (m := START_LINE.fullmatch(line))]


def member_of(p: PeerProc) -> str:
    """The member id a worker registered as (its log, at INFO)."""
    with p.cond:
        for line in p.lines:
            if (m := JOINED.search(line)):
                return m.group(1)
    raise AssertionError(f"{p.name} did not say which member it is:\n{p.output()}")


def result_of(p: PeerProc) -> dict:
    """The RESULT ``p`` printed (waits a little for it: the peer has exited or is exiting)."""
    return json.loads(p.wait_line("RESULT", timeout=5).split(" ", 1)[1])


def results(peers: list[PeerProc]) -> list[dict]:
    """Every ``RESULT <json>`` line the peers printed, decoded (rank 0 prints exactly one)."""
    out = []
    for p in peers:
        with p.cond:
            out += [json.loads(line.split(" ", 1)[1]) for line in p.lines
                    if line.startswith("RESULT ")]
    return out


def _digests_by(peers: list[PeerProc], kind: str) -> dict[str, set[str]]:
    """``<kind> <key> <digest>`` lines of every peer: key -> the digests printed for it."""
    digests: dict[str, set[str]] = {}
    for p in peers:
        with p.cond:
            for line in p.lines:
                if line.startswith(kind + " "):
                    _, key, dig = line.split()
                    digests.setdefault(key, set()).add(dig)
    return digests


def callback_digests(peers: list[PeerProc]) -> dict[str, set[str]]:
    """Generation -> the state digests the peers printed in its reset callbacks. Callbacks
    run once state is synced, so each generation should have one."""
    return _digests_by(peers, "CALLBACK")


def committed_digests(peers: list[PeerProc]) -> dict[int, set[str]]:
    """Every COMMITTED line's digest by commit count (all ranks print the same one)."""
    return {int(commits): d for commits, d in _digests_by(peers, "COMMITTED").items()}


# -- bounded waits ----------------------------------------------------------------------------


def wait_for(p: PeerProc, find: Callable[[], T | None], what: str, timeout: float = 90) -> T:
    """What ``find`` returns once it is not None, rechecked on each new line of ``p``; fails
    saying ``what`` when ``timeout`` passes, or once ``p`` has exited and its every line was
    looked at."""
    deadline = time.monotonic() + timeout
    while True:
        ended = p.ended()  # before looking: its last lines count
        found = find()
        if found is not None:
            return found
        if time.monotonic() > deadline or ended:
            raise AssertionError(f"{p.name}: {what}; output:\n{p.output()}")
        with p.cond:
            p.cond.wait(0.5)


def wait_gen(p: PeerProc, size: int, after: int = 0, timeout: float = 90) -> tuple[int, int]:
    """Wait for a GEN line of a world of ``size`` at index >= ``after``: (index, generation)."""
    return wait_for(p, lambda: next(((i, g) for i, g, _, s in gens(p, after) if s == size), None),
                    f"no GEN of a world of {size} after line {after}", timeout)


def wait_steps_in(p: PeerProc, n: int, generation: int, timeout: float = 90) -> None:
    """Wait until ``p`` printed ``n`` STEP lines in ``generation``."""
    wait_for(p, lambda: True if steps(p, generation) >= n else None,
             f"not {n} steps in generation {generation}", timeout)


def wait_more_steps(p: PeerProc, n: int, timeout: float = 90) -> None:
    """Wait until ``p`` printed ``n`` more STEP lines than it has now."""
    target = steps(p) + n
    wait_for(p, lambda: True if steps(p) >= target else None, f"made no progress ({n} steps)",
             timeout)


def wait_joined(p: PeerProc, after: int = 0, timeout: float = 90) -> tuple[str, int]:
    """Wait for the INFO line saying ``p`` registered: (member id, lease id)."""
    def find() -> tuple[str, int] | None:
        with p.cond:
            for line in p.lines[after:]:
                m = JOINED.search(line)
                if m:
                    return m.group(1), int(m.group(2), 16)
        return None

    return wait_for(p, find, f"no 'joined job' line after line {after}", timeout)


def wait_world(p: PeerProc, size: int, timeout: float, seen: int | None = None) -> float:
    """Seconds until ``p`` prints a GEN line of a world of ``size`` beyond its first
    ``seen`` GEN lines (default: those printed so far)."""
    t0 = time.monotonic()
    seen = len(gen_lines(p)) if seen is None else seen
    wait_for(p, lambda: True if any(world == size for _, _, world in gen_lines(p)[seen:])
             else None, f"no world of {size} within {timeout} s", timeout)
    return time.monotonic() - t0


def start_world_of_3(*peers: PeerProc) -> list[PeerProc]:
    """Wait until every peer trains in a world of 3 (under load they may register apart
    and form smaller worlds first); return them by rank (rank 0, the leader, first)."""
    return start_world_of(3, *peers)


def start_world_of(size: int, *peers: PeerProc) -> list[PeerProc]:
    """:func:`start_world_of_3` for a world of ``size``."""
    for p in peers:
        p.wait_line("GEN", timeout=90)
        wait_world(p, size, 90, seen=0)
    wait_more_steps(peers[0], 3)
    gen = max(g for g, _, w in gen_lines(peers[0]) if w == size)
    rank = {p.name: r for p in peers for g, r, _ in gen_lines(p) if g == gen}
    return sorted(peers, key=lambda p: rank[p.name])
