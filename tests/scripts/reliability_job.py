"""A 2-process job in which one rank fails, or never arrives, while the other waits in a collective.

    python reliability_job.py STRATEGY ACTION RANK OUT_DIR [COLLECTIVE]
    python -m lite_core.cli run --accelerator cpu --devices 2 reliability_job.py ddp ACTION RANK OUT_DIR

STRATEGY `ddp-launch` is `ddp` with the code after `launch()` (no function) instead of in `run()`.

ACTION is what rank RANK does once both ranks are up:

- `raise`: raises `RuntimeError("boom on rank RANK")`;
- `exit`: calls `os._exit(3)`;
- `kill`: sends itself SIGKILL;
- `absent`: never arrives at the collective (sleeps for ten minutes).

Meanwhile every other rank waits in COLLECTIVE (`barrier`, `all_reduce`, `all_gather` or
`broadcast`; default `all_reduce`), which cannot complete. Every rank writes its pid to
`OUT_DIR/pid_rank{r}` and, once both are up, `OUT_DIR/ready_rank{r}`; the failing rank writes the
time of its failure to `OUT_DIR/failed_at`; a rank whose collective returned writes
`OUT_DIR/survived_rank{r}`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lite_core import LightningLite

torch.set_num_threads(1)

COLLECTIVES: dict[str, Callable[[LightningLite], Any]] = {
    "barrier": lambda lite: lite.barrier(),
    "all_reduce": lambda lite: lite.all_reduce(torch.ones(1)),
    "all_gather": lambda lite: lite.all_gather(torch.ones(1)),
    "broadcast": lambda lite: lite.broadcast({"from": lite.global_rank}),
}


class Job(LightningLite):
    def run(self, action: str, acting_rank: int, out_dir: str, collective: str) -> None:
        work(self, action, acting_rank, out_dir, collective)


def work(lite: LightningLite, action: str, acting_rank: int, out_dir: str, collective: str) -> None:
    rank = lite.global_rank
    Path(out_dir, f"pid_rank{rank}").write_text(str(os.getpid()))
    lite.barrier()  # both ranks are up and have written their pid
    Path(out_dir, f"ready_rank{rank}").write_text(str(os.getpid()))
    if rank == acting_rank:
        act(action, rank, out_dir)
    COLLECTIVES[collective](lite)  # never completes: the acting rank does not join
    Path(out_dir, f"survived_rank{rank}").write_text("the collective returned")


def act(action: str, rank: int, out_dir: str) -> None:
    if action == "absent":
        time.sleep(600)
        return
    time.sleep(0.5)  # let the other rank block in its collective
    Path(out_dir, "failed_at").write_text(repr(time.time()))
    if action == "raise":
        raise RuntimeError(f"boom on rank {rank}")
    if action == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    strategy, action, rank, out_dir = sys.argv[1:5]
    collective = sys.argv[5] if len(sys.argv) > 5 else "all_reduce"
    if strategy == "ddp-launch":
        lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
        lite.launch()
        work(lite, action, int(rank), out_dir, collective)
    else:
        Job(accelerator="cpu", strategy=strategy, devices=2).run(action, int(rank), out_dir, collective)
    print("UNEXPECTED: run() returned")


if __name__ == "__main__":
    main()
