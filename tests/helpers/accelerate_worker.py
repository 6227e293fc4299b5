"""The worker of tests/test_accelerate.py: an ``Accelerator`` that gathers every rank.

Writes ``ACCEL_TEST_DIR/rank<N>`` as JSON: the process index and count the ``Accelerator``
sees, the ranks it gathered from every process, the distributed type and the agent's run id,
so the test sees one group of the right size formed by the launchers' rendezvous.
"""

from __future__ import annotations

import json
import os

import torch
from accelerate import Accelerator


def main() -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    index = accelerator.process_index
    gathered = accelerator.gather(torch.tensor([index]))
    report = {
        "process_index": index,
        "num_processes": accelerator.num_processes,
        "gathered": sorted(int(r) for r in gathered.tolist()),
        "distributed_type": str(accelerator.distributed_type),
        "backend": accelerator.state.backend,
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "agent_pid": os.getppid(),
    }
    out = os.environ["ACCEL_TEST_DIR"]
    with open(os.path.join(out, f"rank{index}.tmp"), "w") as f:
        json.dump(report, f)
    os.replace(os.path.join(out, f"rank{index}.tmp"), os.path.join(out, f"rank{index}"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
