"""Which state survives a reset: versions of training state and the rule that picks one.

Pure logic (no torch, no etcd), so the rule can be simulated over thousands of schedules in
a test. ``peer_elastic.elastic`` gathers every rank's :class:`Claim` with one collective and
every rank applies :func:`agree` to the same list, so all reach the same decision.

A :class:`StateVersion` names one consistent training state (model, optimizer, sampler
progress and plain values together). Why the name is unique:

* Ranks of one group move in lockstep: every rank makes the same ``check_host_updates()``
  calls (a commit includes one), because each is a collective. So "the state after the
  ``step``-th check in generation ``generation``" is the same state on every rank that got
  there, and only that group, once, ever produces it. A group is abandoned after its first
  interrupt or failure, and generation numbers only grow.
* A restore returns to the version of the commit restored; a sync hands over the source's
  version. Neither invents a new name.

Why every version is consistent: a commit and an interrupt first merge progress that some
rank recorded only locally (``record_indices``, ``record_all_ranks=False``) with one
all-reduce that completes only with every rank's contribution; only then is the commit saved
or the state kept. A rank whose collective failed restores its last commit, which was saved
merged. So the model never holds a contribution whose progress is missing from the state,
and sampler progress always travels with the model it belongs to: it is never merged across
different versions.

Hence any version is safe to continue from, and choosing the newest only minimises the work
redone. Newest is ``(commits, generation, step)`` in order: the most commits first, then the
most recent generation, then the most steps in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Agreement", "Claim", "StateVersion", "agree", "holders"]


@dataclass(frozen=True, order=True)
class StateVersion:
    """The name of one consistent training state; compares newest-last."""

    commits: int = 0  # commits in this state's history
    generation: int = 0  # generation of the group that produced it (0: never trained)
    step: int = 0  # checks made in that generation when it was produced

    def stepped(self, generation: int) -> StateVersion:
        """The version after one more check in ``generation``."""
        step = self.step + 1 if generation == self.generation else 1
        return StateVersion(self.commits, generation, step)

    def committed(self) -> StateVersion:
        """The version a commit at this point saves."""
        return StateVersion(self.commits + 1, self.generation, self.step)

    def as_ints(self) -> tuple[int, int, int]:
        return (self.commits, self.generation, self.step)


@dataclass(frozen=True)
class Claim:
    """What one rank brings to a new group."""

    version: StateVersion
    needs_state: bool  # never synced, or admitted as a joiner: take state whatever it holds

    def as_ints(self) -> tuple[int, int, int, int]:
        return (int(self.needs_state), *self.version.as_ints())

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> Claim:
        need, commits, generation, step = (int(v) for v in values)
        if min(commits, generation, step) < 0:
            raise ValueError(f"malformed state claim {tuple(values)}")
        return cls(StateVersion(commits, generation, step), bool(need))


@dataclass(frozen=True)
class Agreement:
    """What a new group does with its state."""

    source: int | None  # rank every other rank syncs from; None: all hold the same state
    version: StateVersion  # the version everyone holds afterwards


def agree(claims: Sequence[Claim]) -> Agreement:
    """Sync from the lowest rank holding the newest version, unless nobody needs to.

    Skipping is safe only when every rank already holds the same version (which is then the
    same state, see the module docstring) and nobody asked for state.
    """
    if not claims:
        raise ValueError("no claims to agree on")
    newest = max(c.version for c in claims)
    if all(c.version == newest and not c.needs_state for c in claims):
        return Agreement(None, newest)
    source = next(rank for rank, c in enumerate(claims) if c.version == newest)
    return Agreement(source, newest)


def holders(claims: Sequence[Claim], version: StateVersion) -> tuple[int, ...]:
    """Ranks that hold ``version`` and did not ask for state, in rank order.

    They hold the same state bit for bit (a version names one state), so each can send part
    of a sync; a rank that asked for state is never trusted with what it kept.
    """
    return tuple(rank for rank, c in enumerate(claims)
                 if c.version == version and not c.needs_state)
