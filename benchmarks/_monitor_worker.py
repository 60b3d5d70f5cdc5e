"""Worker: the per-step cost of `ThroughputMonitor.step()` on the tiny model, interleaved.

    python _monitor_worker.py --out FILE ...

Three arms from the same weights, all plain PyTorch loops: `plain`; `lite` = the same loop whose
`optimizer.step()` is followed by `monitor.step(batch_size=8)`, through the same thin wrapper (a monitor with its defaults,
which computes and logs its metrics every 50 steps); `control` = a second plain arm (A/A).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from _common import MODELS, Arm, make_optimizer, run_interleaved, timer_floor_ns, write_json


class MonitoredStep:
    """The optimizer as the timed loop sees it: its step, then the monitor's (if any). Every arm
    goes through this layer, so the difference between arms is the monitor's call alone."""

    def __init__(self, optimizer: torch.optim.Optimizer, monitor: Any, batch_size: int) -> None:
        self.optimizer, self.monitor, self.batch_size = optimizer, monitor, batch_size

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()
        if self.monitor is not None:
            self.monitor.step(batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lite_core import LightningLite, ThroughputMonitor

    spec = MODELS["tiny"]
    base = spec.build(seed=0)
    monitored = copy.deepcopy(base)
    monitor = ThroughputMonitor(LightningLite(accelerator="cpu"), flops_per_step=1e6)
    control = copy.deepcopy(base)
    arms = [Arm(name, model, MonitoredStep(make_optimizer(model), watch, spec.batch))  # type: ignore[arg-type]
            for name, model, watch in (("plain", base, None), ("lite", monitored, monitor), ("control", control, None))]
    run_interleaved(arms, spec.batches(), warmup=args.warmup, reps=args.reps, steps=args.steps)
    write_json(args.out, {"threads": 1, "timer_floor_ns": timer_floor_ns(), "models": {"tiny": {
        "description": f"{spec.description}, + ThroughputMonitor.step()", "reps": args.reps,
        "steps_per_block": args.steps, "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms}}}})


if __name__ == "__main__":
    main()
