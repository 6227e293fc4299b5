"""peer-elastic's etcd layer: everything here talks to etcd through ``client.py``.

gRPC's fork support is turned off for this process, unless its environment already says
otherwise, here, before ``client.py`` imports ``grpc``: gRPC reads the setting once, when it
is first imported. With the support on (gRPC's default on Linux), every ``fork()`` of a
process whose gRPC is running restarts gRPC's poller thread in the child. A child that runs
Python before it execs (``subprocess.Popen(preexec_fn=...)``: ``peer-elastic run`` starts its
peers and its etcd that way, to tie them to its life) then closes its descriptors while that
thread polls one of them, and gRPC aborts the child: measured 13 and 20 children in 1,000 dead
of SIGABRT before they ran, 0 in 3,000 with the support off (gRPC's issue 43055, open: a
regression of grpcio 1.81). With it set to ``1`` such a child can instead hang in gRPC
Python's own fork handler. Off is what gRPC Python documents as its default (its core's
default differs): a forked child that is to use gRPC itself needs it on explicitly, and
setting it keeps it. Nothing of peer-elastic uses gRPC in a forked child without an exec.
"""

from __future__ import annotations

import os

#: The environment variable gRPC reads when it is first imported.
GRPC_FORK_SUPPORT_VAR = "GRPC_ENABLE_FORK_SUPPORT"

os.environ.setdefault(GRPC_FORK_SUPPORT_VAR, "0")
