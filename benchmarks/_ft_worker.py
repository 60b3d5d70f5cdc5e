"""One process of the torchft benchmark (benchmarks/torchft_bench.py): a tiny model's steps.

    python _ft_worker.py OUT STRATEGY STEPS SLEEP

Appends `<step> <committed> <time>` to `OUT/steps-<group>-<pid>` after every optimizer step (the
committed step count of the job under ddp_ft, the step index under ddp), after `start <time>` (the process began) and `loop <time>` (set-up done).
Under ddp_ft it writes the seconds of each of the Manager's calls to `OUT/calls-<group>-<pid>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

START = time.time()


def main(out: Path, strategy: str, steps: int, sleep: float) -> None:
    from lite_core import LightningLite

    group = os.environ.get("REPLICA_GROUP_ID", "ddp")
    x = torch.randn(steps * 8, 32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    class Bench(LightningLite):
        def run(self) -> None:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
            calls = _count_calls(self.strategy) if strategy == "ddp_ft" else {}
            record = out / f"steps-{group}-{os.getpid()}"
            lines = [f"start {START}", f"loop {time.time()}"]  # the first batch opens the first quorum
            for index, (inputs, target) in enumerate(self.setup_dataloaders(loader)):
                optimizer.zero_grad()
                self.backward(torch.nn.functional.mse_loss(net(inputs), target))
                optimizer.step()
                committed = self.strategy.step if strategy == "ddp_ft" else index + 1
                lines.append(f"{index + 1} {committed} {time.time()}")
                if sleep:
                    record.write_text("\n".join(lines) + "\n")
                    time.sleep(sleep)
            record.write_text("\n".join(lines) + "\n")
            if calls and self.global_rank == 0:
                (out / f"calls-{group}-{os.getpid()}.json").write_text(json.dumps(calls))

    # the same work per process: ddp_ft with 2 groups of 1 process, ddp with 2 processes
    Bench(accelerator="cpu", strategy=strategy, devices=1 if strategy == "ddp_ft" else 2).run()


def _count_calls(strategy) -> dict[str, list[float]]:
    """Time each of the Manager's per-step calls (quorum, all-reduce, commit vote): seconds per
    call, an all-reduce's until its result is there."""
    calls: dict[str, list[float]] = {"start_quorum": [], "allreduce": [], "should_commit": []}
    manager = strategy.manager
    for name in calls:
        original = getattr(manager, name)

        def timed(*args, _name=name, _original=original, **kwargs):
            began = time.perf_counter()
            result = _original(*args, **kwargs)
            if _name == "allreduce":
                result.wait()
            calls[_name].append(time.perf_counter() - began)
            return result

        setattr(manager, name, timed)
    return calls


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
