"""Worker: one training loop under `ddp` on one process with or without recompute
(`activation_checkpointing={Block}`), for its activation memory or its step time.

Started by `run.py` once per arm and repetition (a fresh process, so the peak is this arm's own).
The model is activation-heavy (8 residual MLP blocks, 256 -> 1024 -> 256, batch 2048): its
activations are ~9x its parameters. The arms:

- `without`, `with`: Lite's `DDPStrategy()` and `DDPStrategy(activation_checkpointing={Block})`;
- `by-hand`: the loop a user writes without Lite for the same job: a one-process gloo group, torch's
  composable `checkpoint` applied to each block by hand, `DistributedDataParallel`, and
  `loss.backward()`.

Prints one JSON line: the RSS after set-up and the peak RSS after the steps, in MiB (their
difference is what the steps added: activations, gradients, optimizer state; only the activations
differ between `without` and `with`), and the median seconds per step after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Callable

import torch
from torch import nn

from _common import max_rss_mib

WIDTH, HIDDEN, BLOCKS, BATCH = 256, 1024, 8, 2048


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def with_lite(model: nn.Module, optimizer: torch.optim.Optimizer,
              recompute: bool) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]:
    from lite_core import LightningLite
    from lite_core.strategies import DDPStrategy

    strategy = DDPStrategy(activation_checkpointing={Block}) if recompute else DDPStrategy()
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=1)
    lite.launch()
    model, optimizer = lite.setup(model, optimizer)
    return model, optimizer, lite.backward


def by_hand(model: nn.Module, optimizer: torch.optim.Optimizer,
            folder: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]:
    import torch.distributed as dist
    from torch.distributed._composable import checkpoint
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
    for block in model:
        if isinstance(block, Block):
            checkpoint(block)
    return DistributedDataParallel(model), optimizer, torch.Tensor.backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", choices=("without", "with", "by-hand"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)), nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as folder:
        if args.arm == "by-hand":
            model, optimizer, backward = by_hand(model, optimizer, folder)
        else:
            model, optimizer, backward = with_lite(model, optimizer, recompute=args.arm == "with")
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
        after_setup = max_rss_mib()
        times = []
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            times.append(time.perf_counter() - start)
    print(json.dumps({"arm": args.arm, "setup_rss_mib": after_setup, "peak_rss_mib": max_rss_mib(),
                      "step_s": statistics.median(times[args.warmup:])}))


if __name__ == "__main__":
    main()
