"""`profile()` and `ThroughputMonitor` in a 2-process `ddp` job.

    python profile_job.py OUT_DIR

1. Every rank profiles 6 steps (wait 1, warm-up 1, active 2) into OUT_DIR/all, steps marked
   by the monitor's `step()`; the monitor logs its metrics to a CSVLogger in OUT_DIR/logs.
2. Only rank 1 profiles into OUT_DIR/rank1, steps marked by the user's `prof.step()`.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from lite_core import CSVLogger, LightningLite, ThroughputMonitor, measure_flops

torch.set_num_threads(1)


class Job(LightningLite):
    def run(self, out: str) -> None:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        x = torch.randn(4, 8)
        monitor = ThroughputMonitor(self, flops_per_step=measure_flops(model, x), log_every_n_steps=3)
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

        def step() -> None:
            optimizer.zero_grad()
            self.backward(model(x).pow(2).mean())
            optimizer.step()

        with self.profile(os.path.join(out, "all"), wait=1, warmup=1, active=2):
            for _ in range(6):
                step()
                monitor.step(batch_size=len(x))
        with self.profile(os.path.join(out, "rank1"), ranks=[1], wait=0, warmup=1, active=1) as prof:
            for _ in range(3):
                step()
                prof.step()


if __name__ == "__main__":
    out_dir = sys.argv[1]
    Job(accelerator="cpu", strategy="ddp", devices=2, loggers=CSVLogger(os.path.join(out_dir, "logs"))).run(out_dir)
