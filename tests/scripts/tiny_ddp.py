"""A tiny `strategy="ddp"` job, for launching by hand: several nodes, torchrun, concurrent jobs.

    python tiny_ddp.py OUT_DIR DEVICES NUM_NODES

Every process that runs this file writes `OUT_DIR/process_{pid}.json` as soon as it starts
(so the test can count processes); each rank writes `OUT_DIR/rank{global_rank}.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from lite_core import LightningLite

torch.set_num_threads(1)

_ENV_NAMES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID")


class Tiny(LightningLite):
    def run(self, out_dir: str) -> dict:
        rank = self.global_rank
        total = self.all_reduce(torch.tensor(10.0 * (self.node_rank + 1) + rank), reduce_op="sum")
        gathered = self.all_gather(torch.tensor([rank, self.node_rank, self.local_rank, os.getpid()]))
        record = {
            "pid": os.getpid(), "ppid": os.getppid(), "global_rank": rank, "local_rank": self.local_rank,
            "node_rank": self.node_rank, "world_size": self.world_size, "sum": total.item(),
            "gathered": gathered.tolist(), "environment": self.strategy.environment.name,
            "env": {name: os.environ.get(name) for name in _ENV_NAMES},
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        return record


def main() -> None:
    out_dir, devices, num_nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    started = {"pid": os.getpid(), "ppid": os.getppid(), "env": {n: os.environ.get(n) for n in _ENV_NAMES}}
    Path(out_dir, f"process_{os.getpid()}.json").write_text(json.dumps(started))
    lite = Tiny(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=num_nodes)
    result = lite.run(out_dir)
    print(f"RESULT pid={os.getpid()} rank={result['global_rank']} sum={result['sum']}")


if __name__ == "__main__":
    main()
