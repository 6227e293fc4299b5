"""Elastic sharded state: FSDP2 and HSDP models that survive crashes, leaves and joins in
memory, resharded to every new group without a disk read.

``plan`` is the pure planner (where shards live, what moves where); ``catalog`` names the
tensors of a sharded model and optimizer; ``exchange`` moves tensor lists point-to-point;
``state`` is :class:`ShardedState`; ``regroup`` is what a new group runs to take it over.
"""

from __future__ import annotations

from peer_elastic.sharded.grads import sum_gradients
from peer_elastic.sharded.state import ShardedState

__all__ = ["ShardedState", "sum_gradients"]
