"""`LightningLite.launch()` without subclassing.

    python launch_styles.py function OUT_DIR   # ddp_spawn: launch(train, 5) returns rank 0's value
    python launch_styles.py bare OUT_DIR       # ddp: launch() alone; the code after it runs on every rank

Writes `OUT_DIR/rank{r}.json` from each rank and `OUT_DIR/caller_{pid}.json` from each process
that reaches the end of the script.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lite_core import LightningLite

torch.set_num_threads(1)


def train(lite: LightningLite, n: int, out_dir: str) -> dict:
    rank = lite.global_rank
    total = lite.all_reduce(torch.tensor(float(n * (rank + 1))), reduce_op="sum").item()
    record = {"rank": rank, "world_size": lite.world_size, "pid": os.getpid(), "ppid": os.getppid(),
              "n": n, "total": total}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    return record


def main() -> None:
    style, out_dir = sys.argv[1], sys.argv[2]
    if style == "function":
        lite = LightningLite(strategy="ddp_spawn", devices=2, accelerator="cpu")
        returned = lite.launch(train, 5, out_dir)
    else:
        lite = LightningLite(strategy="ddp", devices=2, accelerator="cpu")
        returned = lite.launch()
        # From here on, this runs in both processes.
        record = train(lite, 5, out_dir)
        record["broadcast"] = lite.broadcast({"pid_of_rank0": os.getpid()} if lite.is_global_zero else None)
        record["dist_initialized"] = dist.is_initialized()
        lite.barrier()
        Path(out_dir, f"rank{lite.global_rank}.json").write_text(json.dumps(record))
    caller = {"pid": os.getpid(), "ppid": os.getppid(), "returned": returned}
    Path(out_dir, f"caller_{os.getpid()}.json").write_text(json.dumps(caller))


if __name__ == "__main__":
    main()
