"""Train a small regression model on 2 CPU processes with DDP, from a plain `python` command.

    python examples/ddp_demo.py            # 2 processes, DDP over gloo
    python examples/ddp_demo.py --devices 1 --strategy auto
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite


def make_data(samples: int = 4096, features: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    true_weights = torch.randn(features, 1, generator=generator)
    y = torch.tanh(x @ true_weights) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


class Demo(LightningLite):
    def run(self, epochs: int = 5) -> float:
        self.seed_everything(42)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = self.setup(model, optimizer)
        loader = self.setup_dataloaders(DataLoader(make_data(), batch_size=64, shuffle=True))
        self.print(f"training on {self.world_size} process(es) with {self.strategy.name}")
        for epoch in range(epochs):
            total = torch.zeros(())
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                self.backward(loss)
                optimizer.step()
                total += loss.detach()
            epoch_loss = self.all_reduce(total / len(loader)).item()
            self.print(f"epoch {epoch + 1}/{epochs}  loss {epoch_loss:.4f}")
        return epoch_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    lite = Demo(accelerator="cpu", strategy=args.strategy, devices=args.devices, precision=args.precision)
    final = lite.run(args.epochs)
    if lite.is_global_zero:
        print(f"final loss {final:.4f}")


if __name__ == "__main__":
    main()
