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
redone. Newest is ``(lineage, commits, generation, step)`` in order.

**Lineages.** A lineage is one unbroken history of the state in memory. A new one starts
whenever a group finds no rank holding trained state and starts from the initial state or
loads a durable snapshot (:func:`new_lineage`): a fresh start, or a resume after every
holder was lost. Its number is larger than every lineage the group knows of (claims and
snapshots), so the job's latest such decision always wins: a peer that was parked (a
standby after ``set max_np``, or back from a lost lease) still holds an older lineage, or an
older version of the same one, and never becomes the sync source of a group that has newer
state in memory or on disk. A reused job name whose new run starts from scratch is a new
lineage too, so its snapshots outrank the old run's even at lower commit counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Agreement", "Claim", "StateVersion", "agree", "holders", "new_lineage", "newest_snapshot",
    "should_resume",
]


@dataclass(frozen=True, order=True)
class StateVersion:
    """The name of one consistent training state; compares newest-last."""

    lineage: int = 0  # the unbroken in-memory history it belongs to (0: none started yet)
    commits: int = 0  # commits in this state's history
    generation: int = 0  # generation of the group that produced it (0: never trained)
    step: int = 0  # checks made in that generation when it was produced

    def stepped(self, generation: int) -> StateVersion:
        """The version after one more check in ``generation``."""
        step = self.step + 1 if generation == self.generation else 1
        return StateVersion(self.lineage, self.commits, generation, step)

    def committed(self) -> StateVersion:
        """The version a commit at this point saves."""
        return StateVersion(self.lineage, self.commits + 1, self.generation, self.step)

    @property
    def trained(self) -> bool:
        """Whether this state has been trained at all (else: the script's initial state,
        whatever lineage a group that never stepped gave it)."""
        return (self.commits, self.generation, self.step) != (0, 0, 0)

    def as_ints(self) -> tuple[int, int, int, int]:
        return (self.lineage, self.commits, self.generation, self.step)

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> StateVersion:
        lineage, commits, generation, step = (int(v) for v in values)
        if min(lineage, commits, generation, step) < 0:
            raise ValueError(f"malformed state version {tuple(values)}")
        return cls(lineage, commits, generation, step)


@dataclass(frozen=True)
class Claim:
    """What one rank brings to a new group."""

    version: StateVersion
    needs_state: bool  # never synced, or admitted as a joiner: take state whatever it holds
    # The newest durable snapshot this rank can see (None: none, or no snapshot_dir).
    snapshot: StateVersion | None = None
    # This rank's proposal for a lineage started by the group (its clock, ns).
    proposal: int = 0

    INTS = 10  # length of as_ints()

    def as_ints(self) -> tuple[int, ...]:
        snap = self.snapshot.as_ints() if self.snapshot is not None else (-1, -1, -1, -1)
        return (int(self.needs_state), *self.version.as_ints(), *snap, self.proposal)

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> Claim:
        ints = [int(v) for v in values]
        if len(ints) != cls.INTS:
            raise ValueError(f"malformed state claim {tuple(values)}")
        need, version, snap, proposal = ints[0], ints[1:5], ints[5:9], ints[9]
        snapshot = None if snap == [-1, -1, -1, -1] else StateVersion.from_ints(snap)
        return cls(StateVersion.from_ints(version), bool(need), snapshot, proposal)


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


def newest_snapshot(claims: Sequence[Claim]) -> StateVersion | None:
    """The newest durable snapshot any rank of the group can see."""
    seen = [c.snapshot for c in claims if c.snapshot is not None]
    return max(seen) if seen else None


def should_resume(claims: Sequence[Claim]) -> bool:
    """Whether the group loads a durable snapshot rather than keep what its ranks hold:
    when none of them holds trained state, or some rank sees a snapshot newer than every
    version held (the holders are behind it: a parked peer, or a lineage given up)."""
    if not any(c.version.trained for c in claims):
        return True
    snapshot = newest_snapshot(claims)
    return snapshot is not None and snapshot > max(c.version for c in claims)


def new_lineage(claims: Sequence[Claim]) -> int:
    """The number of a lineage this group starts: rank 0's clock, but always above every
    lineage any rank knows of (held or on disk), so a clock that runs behind cannot put the
    job's latest decision below an older one. The same on every rank (the same list)."""
    known = [c.version.lineage for c in claims]
    known += [c.snapshot.lineage for c in claims if c.snapshot is not None]
    return max(claims[0].proposal, max(known) + 1)


def holders(claims: Sequence[Claim], version: StateVersion) -> tuple[int, ...]:
    """Ranks that hold ``version`` and did not ask for state, in rank order.

    They hold the same state bit for bit (a version names one state), so each can send part
    of a sync; a rank that asked for state is never trusted with what it kept.
    """
    return tuple(rank for rank, c in enumerate(claims)
                 if c.version == version and not c.needs_state)
