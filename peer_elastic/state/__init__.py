"""The training state and its agreement: what survives membership changes, and how a new
group decides which copy it keeps.

* :mod:`.states`: ``State``, ``ObjectState``, ``TorchState``: commit, restore, sync.
* :mod:`.handlers`: a ``StateHandler`` per object kind (module, optimizer, sampler, ...).
* :mod:`.codec` (no torch): plain values as tagged JSON, never pickle.
* :mod:`.sampler`: ``ElasticSampler``: epoch partitioning and progress bitmaps.
* :mod:`.agreement` (no torch): ``StateVersion`` and the rule that picks the state a new
  group keeps.
* :mod:`.lost_state` (no torch): a group with no holder of the state: a fresh run, or every
  holder lost.
* :mod:`.protocol` (no torch): what the run loop, the agreement and snapshots use of a state.
* :mod:`.sync`: a new group agrees on the newest state and syncs it from a holder.

The names below are what a training script or a custom handler uses; they load on first
use, so ``agreement``, ``codec`` and ``lost_state`` import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "State": "peer_elastic.state.states",
    "ObjectState": "peer_elastic.state.states",
    "TorchState": "peer_elastic.state.states",
    "StateHandler": "peer_elastic.state.handlers",
    "register_handler": "peer_elastic.state.handlers",
    # For a custom handler's sync: where state comes from, and how it travels.
    "sync_source": "peer_elastic.torch.transport.sync_source",
    "broadcast_tensors": "peer_elastic.torch.transport.collectives",
    "broadcast_plain": "peer_elastic.torch.transport.collectives",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'peer_elastic.state' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
