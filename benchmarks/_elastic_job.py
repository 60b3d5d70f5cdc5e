"""Elastic scale-down benchmark: two `lite run --nnodes 1:2 --max-restarts 1` "nodes" (one process
each) meeting at a c10d rendezvous on loopback, started by `regions_bench.py`:

    lite run --nnodes 1:2 ... _elastic_job.py OUT_DIR

On the first attempt both ranks train; after step 3 rank 1 writes its pid to OUT_DIR/waiting and
sleeps until the benchmark kills its node's launcher, while rank 0's next step waits in its
all-reduce for it. The lost peer fails that step; node 1's launcher meets the rendezvous again
alone and starts its rank at world size 1, which writes the time its first step returned to
OUT_DIR/trained_at and ends. The scale-down time is that minus the kill's time.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from _common import MODELS, make_optimizer


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", strategy="ddp")
    lite.launch()
    spec = MODELS["tiny"]
    model = spec.build(seed=0)
    model, optimizer = lite.setup(model, make_optimizer(model))
    for step, (x, y) in enumerate(spec.batches(seed=1 + lite.global_rank) * 100):
        optimizer.zero_grad()
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if lite.world_size == 1:
            (out / "trained_at").write_text(repr(time.time()))
            return
        if step == 3 and lite.global_rank == 1:
            (out / "waiting").write_text(str(os.getpid()))
            while True:
                time.sleep(1)


if __name__ == "__main__":
    main()
