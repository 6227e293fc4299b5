"""The timeout of groups the training script makes: the job's, not torch's 30 minutes.

``dist.new_group()`` (and what builds on it: ``new_subgroups``, a device mesh) called without
a ``timeout`` gives the group torch's default: 30 minutes for gloo, 10 for nccl. A peer
whose collective in such a group cannot end any other way waits that long. Such a case
exists: a peer frozen (SIGSTOP, swapping) past its lease may wake with a send that gloo had
queued (frozen in the middle of a large send, or its connections reset meanwhile:
:mod:`peer_elastic.torch.gloo.held_connections`). gloo ends the pair's other waits on the error,
but not that send (``Pair::signalException`` skips queued unbound-buffer sends), so it waits
out its group's timeout before that peer can rejoin (the others train on meanwhile: it
registers again only once it has left the old group,
``GroupManager.left_lost_registration``).

So while a :class:`~peer_elastic.torch.group.GroupManager` exists, torch's default for new
groups is the job's ``collective_timeout_s``, the timeout of every group peer-elastic forms
itself. A ``timeout=`` the script passes is kept.

One job: set and restore torch's module-level defaults (public names of
``torch.distributed.distributed_c10d``, read when a group is made).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["bound_default_timeouts", "restore_default_timeouts"]

#: The module-level defaults ``new_group`` reads (gloo and others; nccl).
_DEFAULTS = ("default_pg_timeout", "default_pg_nccl_timeout")


def bound_default_timeouts(timeout_s: float) -> dict[str, object]:
    """Make ``timeout_s`` torch's default timeout for groups made without one; return the
    previous defaults (for :func:`restore_default_timeouts`)."""
    c10d = dist.distributed_c10d
    previous = {name: getattr(c10d, name) for name in _DEFAULTS if hasattr(c10d, name)}
    for name, value in previous.items():
        if isinstance(value, timedelta):  # nccl's is None in a build without nccl
            setattr(c10d, name, timedelta(seconds=timeout_s))
    return previous


def restore_default_timeouts(previous: dict[str, object]) -> None:
    """Put back what :func:`bound_default_timeouts` returned."""
    c10d = dist.distributed_c10d
    for name, value in previous.items():
        setattr(c10d, name, value)
