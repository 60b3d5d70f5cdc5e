"""Launch benchmark, plain side: run under `python -m torch.distributed.run --nproc-per-node=2`.

Same work as `_launch_lite.py`: gloo process group from torchrun's environment, DDP-wrapped
Linear(32,32), `--steps` SGD steps on batch 8, a final barrier and process-group teardown.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _common import MODELS, make_optimizer, timed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    spec = MODELS["tiny"]
    model = DistributedDataParallel(spec.build(seed=0))
    rank = int(os.environ["RANK"])
    timed_steps(model, make_optimizer(model), spec.batches(seed=1 + rank), args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
