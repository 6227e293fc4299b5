"""peer-elastic: elastic, fault-tolerant PyTorch training with no central driver.

``import peer_elastic`` does not import torch: the training API below is loaded on first
use, so the coordination layer (and the CLI's status/drain) runs in processes without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from peer_elastic.errors import (  # noqa: E402
    ConfigError,
    ElasticTimeout,
    EtcdUnavailable,
    HostsUpdatedInterrupt,
    JobFinished,
    LeaseLost,
    LeaveRequested,
    PeerElasticError,
    ResetLimitExceeded,
    ShardedStateLost,
)

_LAZY = {
    "join": "peer_elastic.api",
    "run": "peer_elastic.api",
    "current_peer": "peer_elastic.api",
    "Peer": "peer_elastic.elastic",
    "State": "peer_elastic.state.states",
    "ObjectState": "peer_elastic.state.states",
    "TorchState": "peer_elastic.state.states",
    "ShardedState": "peer_elastic.sharded",
    "sum_gradients": "peer_elastic.sharded",
    "StateHandler": "peer_elastic.state.handlers",
    "register_handler": "peer_elastic.state.handlers",
    "ElasticSampler": "peer_elastic.state.sampler",
    "DistributedOptimizer": "peer_elastic.optim",
    "allreduce_hook": "peer_elastic.ddp_hook",
    "EXIT_STRAGGLER": "peer_elastic.straggler.policy",
}

__all__ = [
    "__version__",
    "ConfigError",
    "ElasticTimeout",
    "EtcdUnavailable",
    "HostsUpdatedInterrupt",
    "JobFinished",
    "LeaseLost",
    "LeaveRequested",
    "PeerElasticError",
    "ResetLimitExceeded",
    "ShardedStateLost",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'peer_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
