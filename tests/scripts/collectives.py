"""Collectives, ranks and return values under a 2-process strategy; `run()` is called twice.

    python collectives.py STRATEGY OUT_DIR

Each rank writes `OUT_DIR/rank{global_rank}_{call}.json` with what it saw in call 1 and 2 of
`run()`; every process that calls `run()` from the top level writes `OUT_DIR/caller_{pid}.json`
with what `run()` returned to it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import _user_collectives
from lite_core import LightningLite

torch.set_num_threads(1)

# Count process-group initialisations in this process (spawned workers import this module too).
INIT_CALLS = 0
_init_process_group = dist.init_process_group


def _counting_init(*args, **kwargs):
    global INIT_CALLS
    INIT_CALLS += 1
    return _init_process_group(*args, **kwargs)


dist.init_process_group = _counting_init


class Collectives(LightningLite):
    def run(self, call: int, out_dir: str) -> dict:
        rank = self.global_rank
        record = {
            "call": call,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "strategy_id": id(self.strategy),
            "strategy_name": self.strategy.name,
            "environment_ready": self.strategy.environment_ready,
            "dist_initialized": dist.is_initialized(),
            "init_calls_at_start": INIT_CALLS,
            "global_rank": rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "world_size": self.world_size,
            "is_global_zero": self.is_global_zero,
        }

        # barrier: rank 1 arrives late, so rank 0 can only leave after rank 1 got there.
        if rank == 1:
            time.sleep(1.0)
        record["before_barrier"] = time.time()
        self.barrier()
        record["after_barrier"] = time.time()

        payload = {"text": "from rank 0", "items": [1, 2, 3], "call": call} if rank == 0 else None
        record["broadcast"] = self.broadcast(payload, src=0)
        record["broadcast_src1"] = self.broadcast(f"rank {rank} says hi", src=1)

        mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        gathered = self.all_gather(mine)
        record["all_gather_shape"] = list(gathered.shape)
        record["all_gather"] = gathered.tolist()

        value = torch.tensor([rank + 1.0, -3.0 * rank])
        for op in ("sum", "mean", "max"):
            record[f"all_reduce_{op}"] = self.all_reduce(value, reduce_op=op).tolist()
        record["input_after_reduce"] = value.tolist()
        if call == 1:  # numbers, containers and mismatched shapes, as a user's loop passes them
            record["user_collectives"] = _user_collectives.record(self)
        record["init_calls_at_end"] = INIT_CALLS

        Path(out_dir, f"rank{rank}_{call}.json").write_text(json.dumps(record))
        return {"rank": rank, "pid": os.getpid(), "call": call, "answer": 40 + rank}


def main() -> None:
    strategy, out_dir = sys.argv[1], sys.argv[2]
    lite = Collectives(accelerator="cpu", strategy=strategy, devices=2)
    first = lite.run(1, out_dir)
    between = {"environment_ready": lite.strategy.environment_ready, "dist_initialized": dist.is_initialized()}
    second = lite.run(2, out_dir)
    caller = {"pid": os.getpid(), "ppid": os.getppid(), "first": first, "second": second,
              "between": between, "init_calls": INIT_CALLS}
    Path(out_dir, f"caller_{os.getpid()}.json").write_text(json.dumps(caller))


if __name__ == "__main__":
    main()
