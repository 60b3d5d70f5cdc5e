"""A 2-process job in which one rank fails while the other waits in a collective.

    python failing.py STRATEGY MODE OUT_DIR

MODE is `raise1` / `raise0` (that rank raises `RuntimeError("boom on rank N")`) or `exit1` /
`exit0` (that rank calls `os._exit(3)`); prefixed with `launch-`, the same code runs after
`launch()` without a function instead of inside `run()`. Every rank first writes its pid to
`OUT_DIR/pid_rank{r}`; the failing rank writes the time of its failure to `OUT_DIR/failed_at`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from lite_core import LightningLite

torch.set_num_threads(1)


class Failing(LightningLite):
    def run(self, mode: str, out_dir: str) -> None:
        fail(self, mode, out_dir)


def fail(self: LightningLite, mode: str, out_dir: str) -> None:
    rank = self.global_rank
    Path(out_dir, f"pid_rank{rank}").write_text(str(os.getpid()))
    self.barrier()  # both ranks are up and have written their pid
    action, failing_rank = mode[:-1], int(mode[-1])
    if rank == failing_rank:
        time.sleep(0.5)  # let the other rank block in the collective below
        Path(out_dir, "failed_at").write_text(repr(time.time()))
        if action == "raise":
            raise RuntimeError(f"boom on rank {rank}")
        os._exit(3)
    self.all_reduce(torch.ones(1))  # never completes: the failing rank does not join
    self.barrier()
    Path(out_dir, f"survived_rank{rank}").write_text("the collective returned")


def main() -> None:
    strategy, mode, out_dir = sys.argv[1:4]
    if mode.startswith("launch-"):
        lite = LightningLite(accelerator="cpu", strategy=strategy, devices=2)
        lite.launch()
        fail(lite, mode.removeprefix("launch-"), out_dir)
    else:
        Failing(accelerator="cpu", strategy=strategy, devices=2).run(mode, out_dir)
    print("UNEXPECTED: run() returned")


if __name__ == "__main__":
    main()
