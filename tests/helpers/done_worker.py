"""A peer that trains a few steps and returns; for the tests of the ``done`` record.

With ``DONE_WORKER_RANK0_DIES=1`` the rank 0 peer dies (``os._exit(17)``) the moment it
tries to record that the job finished, i.e. after the training function returned on every
rank: whether the job counts as finished then rests on the other ranks.
Prints ``GEN <generation> <rank> <size>`` once formed and ``RETURNED <rank>`` after
``run`` returned.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import peer_elastic as pe


def main() -> int:
    with pe.join() as peer:
        model = nn.Linear(2, 1)
        state = pe.TorchState(model=model, step=0)

        def train(state: pe.TorchState) -> int:
            print("GEN", peer.generation, peer.rank, dist.get_world_size(), flush=True)
            while state.step < 5:
                t = torch.ones(1)
                dist.all_reduce(t)
                state.step += 1
                state.commit()
            if peer.rank == 0 and os.environ.get("DONE_WORKER_RANK0_DIES") == "1":
                def die(*_a: object, **_k: object) -> bool:
                    os._exit(17)

                peer.coordinator.finish = die  # type: ignore[method-assign]
            return peer.rank

        rank = peer.run(train, state)
        print("RETURNED", rank, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
