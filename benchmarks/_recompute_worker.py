"""Worker: activation memory of one training loop under `ddp` on one process, with or without
`activation_checkpointing={Block}` (recompute).

Started by `run.py` once per arm and repetition (a fresh process, so the peak is this arm's own).
The model is activation-heavy (8 residual MLP blocks, 256 -> 1024 -> 256, batch 2048): its
activations are ~9x its parameters. Prints one JSON line: the RSS after set-up and the peak RSS
after the steps, in MiB; their difference is what the steps added (activations, gradients,
optimizer state), and only the activations differ between the arms.
"""

from __future__ import annotations

import argparse
import json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", choices=("without", "with"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lite_core import LightningLite
    from lite_core.strategies import DDPStrategy

    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)), nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    recompute = {"activation_checkpointing": {Block}} if args.arm == "with" else {}
    lite = LightningLite(accelerator="cpu", strategy=DDPStrategy(**recompute), devices=1)
    lite.launch()
    model, optimizer = lite.setup(model, optimizer)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    after_setup = max_rss_mib()
    for _ in range(args.steps):
        optimizer.zero_grad()
        lite.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    print(json.dumps({"arm": args.arm, "setup_rss_mib": after_setup, "peak_rss_mib": max_rss_mib()}))


if __name__ == "__main__":
    main()
