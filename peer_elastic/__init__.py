"""peer-elastic: elastic, fault-tolerant PyTorch training with no central driver."""

from __future__ import annotations

__version__ = "0.1.0"

from peer_elastic.errors import (  # noqa: E402
    ConfigError,
    ElasticTimeout,
    EtcdUnavailable,
    HostsUpdatedInterrupt,
    InternalError,
    JobFinished,
    LeaseLost,
    PeerElasticError,
    ResetLimitExceeded,
)

__all__ = [
    "__version__",
    "ConfigError",
    "ElasticTimeout",
    "EtcdUnavailable",
    "HostsUpdatedInterrupt",
    "InternalError",
    "JobFinished",
    "LeaseLost",
    "PeerElasticError",
    "ResetLimitExceeded",
]
