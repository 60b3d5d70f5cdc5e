"""Worker: the step time of FP8 training on one process, Lite's `Float8Precision` against the same
loop with torchao's conversion and autocast written by hand.

Started by `run.py` once per arm and repetition (a fresh process each). The model is 4 residual MLP
blocks (512 -> 1024 -> 512) and a head, batch 256, SGD; FP8 is emulated (`emulate=True`) so that it
runs on the CPU, which makes the step far slower than on an FP8 GPU: the ratio measures what Lite
adds around torchao, not FP8's speed. Prints one JSON line: the median seconds per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from torch import nn

WIDTH, HIDDEN, BLOCKS, BATCH = 512, 1024, 4, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build(arm: str) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """The model, optimizer and backward of one arm (the head stays in high precision in both)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)), nn.Linear(WIDTH, 16))
    if arm == "plain":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name != str(BLOCKS))
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.Tensor.backward
    from lite_core import Float8Precision, LightningLite

    lite = LightningLite(accelerator="cpu", precision=Float8Precision("rowwise", emulate=True))
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return model, optimizer, lite.backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", choices=("plain", "lite"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, optimizer, backward = build(args.arm)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 16)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.arm == "plain"):  # Lite's precision does it
            out = model(x)
        backward(nn.functional.mse_loss(out.float(), y))
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"arm": args.arm, "step_s": statistics.median(times)}))


if __name__ == "__main__":
    main()
