"""How a new group settles its state: agree on the newest version, then sync from a holder.

:func:`agree_and_sync` is what :class:`~peer_elastic.elastic.Peer` runs on every rank each
time a group forms (a sharded state has its own: ``peer_elastic.sharded.regroup``). The rule
that picks the version is :mod:`peer_elastic.state.agreement`'s; the bytes travel by
:mod:`peer_elastic.torch.transport.collectives`, from the sync source this sets for the
duration of the sync (:func:`~peer_elastic.torch.transport.sync_source.syncing_from`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from peer_elastic.state.agreement import (
    Agreement,
    Claim,
    StateVersion,
    agree,
    holders,
    new_lineage,
    should_resume,
)
from peer_elastic.state.protocol import SyncedState
from peer_elastic.torch.transport.sync_source import syncing_from

__all__ = ["agree_and_sync"]

log = logging.getLogger(__name__)


def agree_and_sync(state: SyncedState, claim: Claim, device: torch.device,
                   resume: Callable[[Sequence[Claim]], Agreement | None] | None = None,
                   committed: StateVersion | None = None) -> Agreement:
    """Agree on the newest state version, then sync from a rank holding it if needed.

    Collective over the default group. One all-gather of every rank's :class:`Claim` (a few
    integers each); every rank applies :func:`peer_elastic.state.agreement.agree` to the same list,
    so all sync from the same source, or all skip the sync when every rank already holds the
    same version and nobody asked for state. Every rank that holds the newest version and
    did not ask for state helps send it (:func:`syncing_from`'s holders: striped when some
    ranks hold it and others not, as in a join). The state everybody ends with is saved as
    the new restore point: a failure before the next commit must not roll a rank back to
    what it held before. ``committed``, the version of this rank's restore point, lets a
    holder whose restore point already is that version skip the copy.

    ``resume`` (durable snapshots) is called on every rank with the gathered claims when
    :func:`~peer_elastic.state.agreement.should_resume` says so: no rank holds trained state, or
    some rank sees a snapshot newer than every version held. It is collective, and returns
    the agreement to sync by when some rank loaded a snapshot into its live state, else
    None. A group that starts from the initial state starts a new lineage.
    """
    mine = torch.tensor(claim.as_ints(), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    claims = [Claim.from_ints(t.tolist()) for t in gathered]
    resumed = None
    tried = resume is not None and should_resume(claims)
    if tried:
        resumed = resume(claims)  # every rank decides the same: the claims are the same list
    agreement = resumed or agree(claims)
    if resumed is None and not agreement.version.trained:
        # The script's initial state: a new lineage, above every one the group knows of.
        agreement = Agreement(agreement.source, StateVersion(lineage=new_lineage(claims)))
    elif tried and resumed is None and agreement.source is None:
        # No snapshot loaded, and every rank holds the same version: a failed load moved
        # its loader's restore point to its live state, so every rank saves (after a sync
        # that changes nothing) and the restore point's version is the agreed one everywhere.
        agreement = Agreement(0, agreement.version)
    if agreement.source is None:
        return agreement
    if len({c.version for c in claims}) > 1:
        log.info("state versions differ (%s): adopting %s from rank %d",
                 ", ".join(str(c.version.as_ints()) for c in claims),
                 agreement.version.as_ints(), agreement.source)
    # A resumed state lives on the loading rank only; otherwise every holder can serve.
    holding = () if resumed is not None else holders(claims, agreement.version)
    with syncing_from(agreement.source, holding if agreement.source in holding else ()):
        state.sync()
    state.commit_count = agreement.version.commits
    if not (dist.get_rank() in holding and committed == agreement.version):
        state.save()
    return agreement

