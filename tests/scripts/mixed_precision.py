"""`bf16-mixed` training on 2 processes, and random draws in seeded dataloader workers.

    python mixed_precision.py STRATEGY OUT_DIR

Each rank writes `OUT_DIR/rank{R}.pt`: its loss at every step of SGD on its half of a fixed
batch (the same loop under every strategy), whether autocast was on inside `autocast()`, and,
under `ddp`, what each dataloader worker drew from torch, NumPy and `random` in two passes
after the same `seed_everything` call.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lite_core import LightningLite

torch.set_num_threads(1)

STEPS = 6
LR = 0.1


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)


class Draws(Dataset):
    """Each sample is what the worker that loads it draws from torch, NumPy and `random`."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        worker = get_worker_info()
        return torch.tensor([worker.id, torch.rand(1).item(), np.random.rand(), random.random()],
                            dtype=torch.float64)


class MixedPrecision(LightningLite):
    def run(self, out_dir: str) -> None:
        results = {"losses": self.train(), "autocast_in_context": self.autocast_is_on()}
        if self.strategy.name == "ddp":
            results["worker_draws"] = [self.worker_draws() for _ in range(2)]
        torch.save(results, Path(out_dir, f"rank{self.global_rank}.pt"))

    def train(self) -> list[float]:
        torch.manual_seed(0)
        model = self.setup_module(make_model())
        optimizer = self.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
        x, y = make_data()
        x, y = x[self.global_rank::2], y[self.global_rank::2]
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            self.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        return losses

    def autocast_is_on(self) -> bool:
        with self.autocast():
            return torch.is_autocast_enabled("cpu")

    def worker_draws(self) -> torch.Tensor:
        self.seed_everything(42, workers=True)
        loader = self.setup_dataloaders(DataLoader(Draws(), batch_size=1, num_workers=2))
        return torch.cat(list(loader))


def main() -> None:
    strategy, out_dir = sys.argv[1], sys.argv[2]
    MixedPrecision(accelerator="cpu", strategy=strategy, devices=2, precision="bf16-mixed").run(out_dir)


if __name__ == "__main__":
    main()
