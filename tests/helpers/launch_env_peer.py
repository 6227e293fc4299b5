"""A peer that says what ``peer-elastic run`` gave it: one line ``ENV {json}`` with the
launch variables, the level of the ``peer_elastic`` logger after the library set it up, and
(with ``--join``, through a real :func:`peer_elastic.join`) ``peer.local_rank``."""

from __future__ import annotations

import json
import logging
import os
import sys

NAMES = ("PEER_ELASTIC_JOB", "PEER_ELASTIC_ETCD", "PEER_ELASTIC_LOCAL_RANK",
         "PEER_ELASTIC_LOG_LEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT")

report: dict[str, object] = {name: os.environ.get(name) for name in NAMES}
if "--join" in sys.argv:
    import peer_elastic as pe

    with pe.join() as peer:
        report["local_rank"] = peer.local_rank
else:
    from peer_elastic import logs

    logs.setup()
report["log_level"] = logging.getLevelName(logging.getLogger("peer_elastic").level)
print("ENV " + json.dumps(report), flush=True)
