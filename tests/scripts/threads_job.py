"""Each rank notes the threads torch computes on, as a user would check them.

    python threads_job.py OUT_DIR LABEL STRATEGY [STRATEGY ...] [--devices N] [--one-core]
    lite run --devices 2 threads_job.py OUT_DIR LABEL ddp

Runs one job of `devices` CPU processes (default 2) per STRATEGY, in turn, and each rank writes
`OUT_DIR/LABEL-STRATEGY-rank{r}.json`: `torch.get_num_threads()` and `OMP_NUM_THREADS` as the rank
sees them. `--one-core` first pins this process to one core (its ranks inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from lite_core import LightningLite


class Threads(LightningLite):
    def run(self, out_dir: str, name: str) -> None:
        record = {"threads": torch.get_num_threads(), "variable": os.environ.get("OMP_NUM_THREADS")}
        Path(out_dir, f"{name}-rank{self.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("label")
    parser.add_argument("strategies", nargs="+")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--one-core", action="store_true")
    args = parser.parse_args()
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    for strategy in args.strategies:
        job = Threads(accelerator="cpu", strategy=strategy, devices=args.devices)
        job.run(args.out_dir, f"{args.label}-{strategy}")


if __name__ == "__main__":
    main()
