"""Deciding the next generation: a pure function of the watched picture.

Only the leader acts on the result, but every peer can compute it, which keeps the rule in
one place and makes it easy to test without etcd.

Rules:

* Eligible members are live, not drained, not fenced, not on a blacklisted host, not cut off
  from the others' process groups (:mod:`~peer_elastic.etcd.reach`), and not *silent*
  (in the current roster, yet without an ack past ``join_timeout``, or without an ack and
  confirmed dead by a refused probe: :mod:`~peer_elastic.etcd.deaths`).
* The next roster keeps the surviving members of the current roster in their rank order,
  then adds newcomers oldest first, up to ``max_np``. Rank 0 is therefore the oldest
  surviving holder of the training state; a newcomer never becomes rank 0 while one survives.
* No roster is formed with fewer than ``min_np`` members.
* A roster fits in ``roster_budget`` bytes of member ids (:data:`ROSTER_BUDGET_BYTES`), so
  the generation record (roster, joined and removed lists) stays under etcd's request size
  limit. Members beyond it wait as standbys, as beyond ``max_np``.
* Joins and graceful leaves wait ``settle_s`` of quiet so a burst becomes one generation;
  the first generation waits ``start_settle_s`` unless ``max_np`` members are already there.
  A broken generation or a silent member is acted on at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from peer_elastic.etcd.deaths import Death
from peer_elastic.etcd.view import ViewSnapshot
from peer_elastic.records import GenerationCause, JobConfig


@dataclass(frozen=True)
class GenerationPlan:
    """What the leader should write, or (``roster`` empty) why and until when it waits."""

    number: int
    roster: tuple[str, ...]
    reason: str  # for humans; decisions read ``causes``
    joined: tuple[str, ...]
    removed: tuple[str, ...]
    dropped: tuple[str, ...]  # silent members removed (their leases are revoked)
    broken: bool
    causes: tuple[GenerationCause, ...] = ()


@dataclass(frozen=True)
class Wait:
    """No generation to write now; look again at ``until`` (monotonic) or on any change."""

    why: str
    until: float | None = None


#: etcd allows 128 operations per transaction; each dropped member costs one guard.
MAX_DROPS_PER_GENERATION = 100

#: Member-id bytes one roster may hold. A generation record carries the roster and the
#: joined and removed lists (each at most a roster), so 384 KiB keeps it well under etcd's
#: default 1.5 MiB request limit: about 10,000 members with ids of 30-40 bytes.
ROSTER_BUDGET_BYTES = 384 << 10

#: Member ids named in a reason string (the rest are counted).
_IDS_IN_REASON = 8


def _id_bytes(member_id: str) -> int:
    """One roster entry in a generation record (protobuf: tag + length + bytes)."""
    return len(member_id.encode()) + 3


def roster_bytes(ids: Collection[str]) -> int:
    """What ``ids`` cost in a generation record."""
    return sum(_id_bytes(i) for i in ids)


def _fit(ids: list[str], budget: int) -> list[str]:
    """The longest prefix of ``ids`` within ``budget`` bytes."""
    used = 0
    for k, i in enumerate(ids):
        used += _id_bytes(i)
        if used > budget:
            return ids[:k]
    return ids


def _names(ids: Collection[str]) -> str:
    shown = list(ids)[:_IDS_IN_REASON]
    more = len(ids) - len(shown)
    return ",".join(shown) + (f" (+{more} more)" if more > 0 else "")


def plan_next_generation(
    snap: ViewSnapshot, cfg: JobConfig, silent: Collection[str], now: float,
    roster_budget: int = ROSTER_BUDGET_BYTES, deaths: Mapping[str, Death] | None = None,
) -> GenerationPlan | Wait:
    """The next generation, or why not yet (module docstring). ``deaths`` (confirmed by
    probe) only explain drops in the reason; ``silent`` decides them."""
    gen = snap.generation
    prev = tuple(gen.roster) if gen is not None else ()
    # The rest of the silent members are dropped in the next round.
    silent_now = set(sorted(m for m in silent if m in prev and m in snap.members)
                     [:MAX_DROPS_PER_GENERATION])
    eligible = [m.id for m in snap.eligible() if m.id not in silent_now]
    eligible_set = set(eligible)
    survivors = [m for m in prev if m in eligible_set]
    # Paused: the roster is frozen against joins (they wait as standbys), but departures,
    # crashes and broken generations are still handled so training can go on. Only so many
    # newcomers as keep the roster at min_np are let in: a member whose lease lapsed (a stall,
    # a blip of its network) comes back as a newcomer, and a paused job whose members all
    # did so would otherwise stop until resumed, or fail at the elastic timeout.
    newcomers = [m for m in eligible if m not in set(survivors)]
    if cfg.paused:
        newcomers = newcomers[:max(0, cfg.min_np - len(survivors))]
    wanted = (survivors + newcomers)[: cfg.max_np or None]
    roster = tuple(_fit(wanted, roster_budget))
    capped = len(wanted) - len(roster)
    broken = gen is not None and any(m in prev for m in snap.broken.get(gen.number, {}))
    dropped = tuple(m for m in prev if m in silent_now)

    if cfg.paused and gen is None:
        return Wait("paused")
    if len(roster) < cfg.min_np:
        gone = tuple(m for m in prev if m not in roster)
        if gone:
            # Members left or died and too few remain: a generation with an EMPTY roster
            # stops everyone together (a leaver can go; nobody trains below min_np), and
            # the rest wait for peers under the elastic timeout.
            _, causes = _departures(snap, gone, dropped, broken, deaths or {})
            return GenerationPlan(
                number=gen.number + 1,  # type: ignore[union-attr]
                roster=(), reason=f"waiting: {len(roster)} of min_np={cfg.min_np} peers "
                f"(gone: {_names(gone)})", joined=(), removed=gone,
                dropped=dropped, broken=broken,
                causes=(GenerationCause.GENERATION_CAUSE_BELOW_MIN_NP, *causes))
        return Wait(f"{len(roster)} of min_np={cfg.min_np} peers available")
    quiet = now - snap.membership_changed_at
    if gen is None:
        full = cfg.max_np and len(roster) >= cfg.max_np
        if not full and quiet < cfg.start_settle_s:
            return Wait("first generation: waiting for more peers",
                        snap.membership_changed_at + cfg.start_settle_s)
    elif roster == prev and not broken:
        return Wait("paused" if cfg.paused else "roster unchanged")
    elif not broken and not silent_now and quiet < cfg.settle_s:
        return Wait("settling", snap.membership_changed_at + cfg.settle_s)
    return _plan(snap, roster, capped, dropped, broken, deaths or {})


def _plan(snap: ViewSnapshot, roster: tuple[str, ...], capped: int, dropped: tuple[str, ...],
          broken: bool, deaths: Mapping[str, Death]) -> GenerationPlan:
    """The generation that installs ``roster``, with its reason and causes."""
    gen = snap.generation
    prev = tuple(gen.roster) if gen is not None else ()
    joined = tuple(m for m in roster if m not in prev)
    removed = tuple(m for m in prev if m not in roster)
    parts, causes = _departures(snap, removed, dropped, broken, deaths)
    if gen is None:
        parts.insert(0, "first generation")
        causes.insert(0, GenerationCause.GENERATION_CAUSE_FIRST)
    if joined and gen is not None:
        parts.append("joined: " + _names(joined))
        causes.append(GenerationCause.GENERATION_CAUSE_JOINED)
    if capped:
        parts.append(f"roster capped at {len(roster)} members by the record size limit "
                     f"({capped} more wait as standbys)")
        causes.append(GenerationCause.GENERATION_CAUSE_CAPPED)
    return GenerationPlan(
        number=(gen.number if gen is not None else 0) + 1,
        roster=roster,
        reason="; ".join(parts),
        joined=joined,
        removed=removed,
        dropped=dropped,
        broken=broken,
        causes=tuple(causes),
    )


def _departures(snap: ViewSnapshot, removed: tuple[str, ...], dropped: tuple[str, ...],
                broken: bool, deaths: Mapping[str, Death]) -> tuple[list[str], list[GenerationCause]]:
    """Why ``removed`` left the roster (and whether it broke): reason parts and causes."""
    parts: list[str] = []
    causes: list[GenerationCause] = []
    if broken:
        n = snap.generation.number  # type: ignore[union-attr]
        parts.append("broken by " + _names(sorted(snap.broken[n])))
        causes.append(GenerationCause.GENERATION_CAUSE_BROKEN)
    gone = [m for m in dropped if m in deaths]
    timed_out = [m for m in dropped if m not in deaths]
    if gone:
        shown = gone[:_IDS_IN_REASON]
        more = f" (+{len(gone) - len(shown)} more)" if len(gone) > len(shown) else ""
        parts.append("dropped: " + ", ".join(f"{m} ({deaths[m].describe()})" for m in shown)
                     + more)
    if timed_out:
        parts.append("dropped (no ack within join_timeout): " + _names(timed_out))
    if dropped:
        causes.append(GenerationCause.GENERATION_CAUSE_DROPPED)
    # A member that fenced itself (its training thread hung) went with a record saying so.
    undropped = [m for m in removed if m not in dropped]
    hung = [m for m in undropped if m in snap.fenced]
    if hung:
        parts.append("hung (training thread stuck past hang_timeout_s): " + _names(hung))
        causes.append(GenerationCause.GENERATION_CAUSE_HUNG)
    # cut_off() holds live members only; a drained one that is also cut off left gracefully.
    cut = snap.cut_off()
    unreachable = [m for m in undropped if m not in snap.fenced and m in cut
                   and m not in snap.drains]
    if unreachable:
        parts.append("cut off from the others' process groups (reported unreachable): "
                     + _names(unreachable))
        causes.append(GenerationCause.GENERATION_CAUSE_UNREACHABLE)
    left = [m for m in undropped if m not in snap.fenced and m not in unreachable]
    if left:
        parts.append("left: " + _names(left))
        causes.extend(c for c in _LEFT_CAUSES if any(_left_cause(snap, m) == c for m in left))
    return parts, causes


_LEFT_CAUSES = (GenerationCause.GENERATION_CAUSE_LEFT, GenerationCause.GENERATION_CAUSE_EXPIRED,
                GenerationCause.GENERATION_CAUSE_RESIZED)


def _left_cause(snap: ViewSnapshot, member_id: str) -> GenerationCause:
    """A removed member that was neither dropped nor fenced: drained (a graceful leave),
    its key gone without one (its process died, or it lost its lease), or still a live
    member that no longer fits (max_np lowered, the size cap, its host blacklisted)."""
    if member_id in snap.drains:
        return GenerationCause.GENERATION_CAUSE_LEFT
    if member_id not in snap.members:
        return GenerationCause.GENERATION_CAUSE_EXPIRED
    return GenerationCause.GENERATION_CAUSE_RESIZED


def silence_deadline(owing_since: float, floor: float, join_timeout_s: float) -> float:
    """When a roster member that owes an ack since ``owing_since`` becomes silent:
    ``join_timeout_s`` later, the clock starting no earlier than ``floor`` (see
    :func:`silent_members`). The leader also wakes then (``Leader.step``'s next look)."""
    return max(owing_since, floor) + join_timeout_s


def silent_members(snap: ViewSnapshot, seen_at: float | None, join_timeout_s: float,
                   now: float, settled_at: float = 0.0,
                   broken_seen_at: float | None = None,
                   deaths: Mapping[str, Death] | None = None) -> dict[str, str]:
    """Roster members of the current generation that gave no proof of life in time.

    Returns member id -> the ack it failed to give (``"ready"`` or ``"alive"``), which is also
    the key the drop must guard on (still absent when the drop is written):

    * ``ready``: no acknowledgement of the generation ``join_timeout`` after it appeared;
    * ``alive``: the generation broke (a collective failed) and the member's coordination
      thread did not answer "alive" within ``join_timeout``. This is what catches a dead
      *leader*: it acknowledged the generation long ago, and it is the one who would have
      written the next.

    A member in ``deaths`` (its probe port refused a connection: its process is gone) that
    still owes one of these acks is silent at once, without waiting for ``join_timeout``.

    The clock starts no earlier than the view's last (re)connection to etcd, nor than
    ``settled_at`` (when etcd was last seen disrupted, plus the time a stalled request needs
    to fail over): while etcd is unreachable or electing a leader, healthy members cannot
    ack, and that must not make them look silent.
    """
    gen = snap.generation
    out: dict[str, str] = {}
    if gen is None:
        return out
    # Every member asks on every change it sees: the snapshot's shared lists of who owes
    # which ack keep this O(owing), not O(roster), per member.
    floor = max(snap.connected_at, settled_at)
    if seen_at is not None and now >= silence_deadline(seen_at, floor, join_timeout_s):
        out.update({m: "ready" for m in snap.not_ready()})
    if snap.broken.get(gen.number) and broken_seen_at is not None \
            and now >= silence_deadline(broken_seen_at, floor, join_timeout_s):
        for m in snap.not_alive():
            out.setdefault(m, "alive")
    if deaths and snap.owing_acks():
        not_ready = frozenset(snap.not_ready())
        for m in snap.not_ready() + snap.not_alive():
            if m not in out and m in deaths:
                out[m] = "ready" if m in not_ready else "alive"
    return out
