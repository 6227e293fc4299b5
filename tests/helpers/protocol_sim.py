"""An in-process model of the per-step protocol, for thousands of seeded schedules a second.

It models what the real ranks do with their state (``peer_elastic.elastic.Peer``): lockstep
steps whose gradient all-reduce adds every rank's samples to the model, progress recorded for
all ranks (``record_batch``) or on the recording rank only (``record_indices``), checks and
commits every k steps (the flags all-reduce, then the merge of local progress, then the save),
and restore after a failed collective. Events land inside any of those collectives: a crash
(the dying rank contributed or not; a completed all-reduce reached a random subset of the
others), a graceful leave, a join, a member parked by a resize and brought back later. Each
new group decides with the real :func:`peer_elastic.state.agreement.agree`.

The model is a counter: ``counts[i]`` is how often sample ``i`` reached the model. A state is
consistent when exactly the samples its progress marks are counted once and no other. The
checks: the state a group continues from is consistent, ranks that skip the sync hold equal
states, and at the end every sample was trained exactly once.

``Rule.OLD`` is the pre-issue-9 rule (newest commit count wins; sampler progress OR-merged at
sync; no merge before a reset), kept to show the model finds what that rule got wrong.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field, replace

from peer_elastic.state.agreement import Agreement, Claim, StateVersion, agree


class Rule(enum.Enum):
    CURRENT = "current"
    OLD = "old"


class Recording(enum.Enum):
    ALL_RANKS = "record_batch"
    LOCAL = "record_indices"


@dataclass(frozen=True)
class Snap:
    """One rank's training state."""

    counts: tuple[int, ...]
    done: frozenset[int]  # progress every rank of its group knows
    local: frozenset[int]  # progress recorded on this rank only, not merged yet
    version: StateVersion
    commits: int = 0  # what the old rule compared


@dataclass
class SimPeer:
    name: int
    live: Snap
    saved: Snap
    synced: bool = False
    joined_now: bool = True
    restored: bool = False


class Violation(AssertionError):
    pass


@dataclass
class Outcome:
    resets: int = 0
    events: list[str] = field(default_factory=list)


def _fresh(n: int, rng: random.Random) -> Snap:
    garbage = tuple(rng.choice((0, 3, 7)) for _ in range(n))  # a fresh model's own weights
    return Snap(garbage, frozenset(), frozenset(), StateVersion())


def _consistent(s: Snap, n: int) -> bool:
    marked = s.done | s.local
    return all(s.counts[i] == (1 if i in marked else 0) for i in range(n))


def run_schedule(seed: int, *, n: int = 24, rule: Rule = Rule.CURRENT,
                 recording: Recording | None = None, max_resets: int = 40) -> Outcome:
    """Play one seeded schedule to the end of the epoch; raise :class:`Violation` if the
    contract breaks."""
    rng = random.Random(seed)
    recording = recording or rng.choice(list(Recording))
    commit_every = rng.choice((1, 2, 5))
    out = Outcome()
    names = iter(range(1000))
    members = []
    for _ in range(rng.randint(2, 4)):
        fresh = _fresh(n, rng)
        members.append(SimPeer(next(names), fresh, fresh))
    parked: list[SimPeer] = []
    generation = 0

    def say(text: str) -> None:
        out.events.append(f"g{generation}: {text}")

    while True:
        generation += 1
        out.resets += 1
        if out.resets > max_resets:
            raise Violation(f"seed {seed}: no progress after {max_resets} groups: {out.events}")
        group = members
        # ---- agree and sync ------------------------------------------------------------
        if rule is Rule.CURRENT:
            claims = [Claim(p.live.version, not p.synced or p.joined_now) for p in group]
            agreement = agree(claims)
        else:
            agreement = _old_agree(group)
        if agreement.source is None:
            if len({p.live for p in group}) != 1:
                raise Violation(f"seed {seed}: sync skipped over different states: {out.events}")
        else:
            src = group[agreement.source].live
            if rule is Rule.OLD:
                merged = frozenset().union(*(p.live.done | p.live.local for p in group))
                src = replace(src, done=merged, local=frozenset())
            if src.version == StateVersion():
                # A fresh model (its own random weights, modelled as garbage counts) is the
                # right start only for a job in which nobody trained yet; then it counts
                # nothing.
                if any(p.live.version != StateVersion() for p in group):
                    raise Violation(f"seed {seed}: a fresh state won over trained ones: "
                                    f"{out.events}")
                src = replace(src, counts=(0,) * n)
            if not _consistent(src, n):
                raise Violation(f"seed {seed}: continued from an inconsistent state "
                                f"{src} ({recording.value}): {out.events}")
            adopted = replace(src, done=src.done | src.local, local=frozenset(),
                              version=agreement.version)
            for p in group:
                p.live = p.saved = adopted
        for p in group:
            p.synced, p.joined_now, p.restored = True, False, False
        say(f"formed {[p.name for p in group]} from {agreement.source}")
        # ---- train in this group until it ends ----------------------------------------
        remaining = sorted(set(range(n)) - group[0].live.done)
        if not remaining:
            break
        world = len(group)
        shards = [remaining[r::world] for r in range(world)]
        calm = out.resets > max_resets // 2  # no more events: let the epoch finish
        ended = _train(group, shards, generation, commit_every, recording, rule, rng, calm, say)
        if ended is None:  # finished the epoch in this group
            final = group[0].live
            if any(p.live.counts != final.counts for p in group):
                raise Violation(f"seed {seed}: ranks differ at the end: {out.events}")
            marked = frozenset().union(*(p.live.done | p.live.local for p in group))
            if final.counts != (1,) * n or marked != frozenset(range(n)):
                raise Violation(f"seed {seed}: not exactly once: {final.counts} "
                                f"({recording.value}): {out.events}")
            return out
        survivors, left = ended
        members = survivors
        for p in left:
            parked.append(p)
        # membership changes that happen between groups
        if rng.random() < 0.3 or len(members) == 0:
            joiner = _fresh(n, rng)
            members.append(SimPeer(next(names), joiner, joiner))
            say("join")
        if parked and rng.random() < 0.4:
            back = parked.pop(rng.randrange(len(parked)))
            back.joined_now = True
            members.append(back)
            say(f"{back.name} returns")
    return out


def _old_agree(group: list[SimPeer]) -> Agreement:
    """The rule before issue 9: newest commit count wins; sync only when commits differ,
    a rank never synced, or a rank restored."""
    commits = [p.live.commits for p in group]
    version = max(p.live.version for p in group)
    if min(commits) != max(commits):
        return Agreement(commits.index(max(commits)), version)
    if any(not p.synced or p.restored for p in group):
        return Agreement(0, version)
    return Agreement(None, version)


def _train(group: list[SimPeer], shards: list[list[int]], generation: int, commit_every: int,
           recording: Recording, rule: Rule, rng: random.Random, calm: bool,
           say) -> tuple[list[SimPeer], list[SimPeer]] | None:
    """Steps in lockstep until the epoch ends (None) or the group breaks: returns the members
    that go on to the next group, and those parked (alive, state kept, out of the roster)."""
    steps = max(len(s) for s in shards)
    current = rule is Rule.CURRENT
    for b in range(steps):
        taken = [s[b] if b < len(s) else None for s in shards]
        contribution = [i for i in taken if i is not None]
        event = None if calm else _draw_event(rng, len(group))
        if event == "crash_in_step":  # the gradient all-reduce fails: everyone restores
            victim = rng.randrange(len(group))
            say(f"{group[victim].name} dies in a step")
            return _after_failure(group, victim), []
        for r, p in enumerate(group):  # the step, applied on every rank alike
            counts = list(p.live.counts)
            for i in contribution:
                counts[i] += 1
            if recording is Recording.ALL_RANKS:
                done, local = p.live.done | set(contribution), p.live.local
            else:
                done = p.live.done
                local = p.live.local | ({taken[r]} if taken[r] is not None else set())
            p.live = replace(p.live, counts=tuple(counts), done=frozenset(done),
                             local=frozenset(local), version=p.live.version.stepped(generation))
        committing = (b + 1) % commit_every == 0
        local_any = any(p.live.local for p in group)
        if event == "crash_in_merge" and not (current and local_any):
            event = "crash_in_flags"  # no merge collective happens at this step
        if event in ("crash_in_flags", "crash_in_merge"):
            _crash_in_check(group, event, committing, local_any, rule, rng, say)
            return [p for p in group if p.live is not None], []
        interrupt = event in ("leave", "join", "park")
        if current and local_any and (interrupt or committing):
            _merge_all(group, group)
        if committing:
            for p in group:
                _commit(p)
        if interrupt:
            say(event)
            if event == "join":
                return list(group), []
            who = rng.randrange(len(group))
            rest = [p for r, p in enumerate(group) if r != who]
            if not rest:
                return list(group), []
            return rest, ([group[who]] if event == "park" else [])
    return None


def _crash_in_check(group: list[SimPeer], event: str, committing: bool, local_any: bool,
                    rule: Rule, rng: random.Random, say) -> None:
    """A rank dies inside the check's flags all-reduce or the merge that follows it. The
    all-reduce completes on a random subset of the others only if the dying rank
    contributed. Those that complete may also have seen a reset pending (then they keep live
    state); everyone else ends up restoring its last commit. The dead rank's ``live`` is
    set to None."""
    victim = rng.randrange(len(group))
    contributed = rng.random() < 0.5
    others = [r for r in range(len(group)) if r != victim]
    completed = {r for r in others if contributed and rng.random() < 0.5}
    pending_reset = rng.random() < 0.5
    say(f"{group[victim].name} dies in {event[9:]} (contributed={contributed}, completed on "
        f"{sorted(group[r].name for r in completed)}, reset pending={pending_reset})")
    current = rule is Rule.CURRENT
    before = [p.live for p in group]  # what each rank held entering the collective
    union = frozenset().union(*(s.local for s in before))
    for r in others:
        p = group[r]
        if not current and committing:
            _commit(p)  # the old order: save, then the check
        ok = r in completed
        if current and local_any and event == "crash_in_flags":
            ok = False  # the merge that follows needs the dead rank: it fails
        if ok and current:
            if local_any:  # the merge completed here: it holds every rank's records
                p.live = replace(p.live, done=p.live.done | union, local=frozenset())
            if committing:
                _commit(p)
        if not (ok and pending_reset):
            p.live = p.saved
            p.restored = True
    group[victim].live = None  # type: ignore[assignment]


def _merge_all(group: list[SimPeer], into: list[SimPeer]) -> None:
    union = frozenset().union(*(p.live.local for p in group))
    for p in into:
        p.live = replace(p.live, done=p.live.done | union, local=frozenset())


def _commit(p: SimPeer) -> None:
    p.live = replace(p.live, version=p.live.version.committed(), commits=p.live.commits + 1)
    p.saved = p.live


def _after_failure(group: list[SimPeer], victim: int) -> list[SimPeer]:
    """Survivors of a failed collective restore their last commit."""
    survivors = [p for r, p in enumerate(group) if r != victim]
    for p in survivors:
        p.live = p.saved
        p.restored = True
    return survivors


_EVENTS = ("crash_in_step", "crash_in_flags", "crash_in_merge", "leave", "join", "park")


def _draw_event(rng: random.Random, world: int) -> str | None:
    if rng.random() >= 0.12:
        return None
    event = rng.choice(_EVENTS)
    if world == 1 and event.startswith("crash"):
        return None  # keep one member alive; a lone crash is the whole job dying
    return event
