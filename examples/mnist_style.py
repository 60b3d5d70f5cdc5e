"""An MNIST-style loop with Lite: train, evaluate with a summed Python float, save a checkpoint.

    python examples/mnist_style.py                                   # one process
    python examples/mnist_style.py --strategy ddp --devices 2        # or ddp_spawn, fsdp, ...
    lite run --strategy ddp --devices 2 examples/mnist_style.py

The data is a synthetic 8x8 "digits" set made inside `run()`: each class is a fixed random
pattern plus noise. The test loop adds each batch's loss to a Python float, as MNIST examples do,
and `self.all_reduce(test_loss, reduce_op="sum")` adds the processes' floats up, so every process
prints the same test loss. Choices not given here are left to `lite run` (or LITE_* variables).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

CLASSES = 10


def make_digits(samples: int, seed: int) -> TensorDataset:
    """`samples` noisy 8x8 images of `CLASSES` fixed patterns, with their labels."""
    patterns = torch.rand(CLASSES, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    images = patterns[labels] + 0.3 * torch.randn(samples, 1, 8, 8, generator=generator)
    return TensorDataset(images, labels)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, CLASSES))


class MnistStyle(LightningLite):
    def run(self, args: argparse.Namespace) -> float:
        self.seed_everything(args.seed)
        model = make_model()
        model, optimizer = self.setup(model, torch.optim.Adam(model.parameters(), lr=args.lr))
        train_loader, test_loader = self.setup_dataloaders(
            DataLoader(make_digits(512, seed=1), batch_size=args.batch_size, shuffle=True),
            DataLoader(make_digits(128, seed=2), batch_size=args.batch_size),
        )
        for epoch in range(args.epochs):
            self.train_one_epoch(model, optimizer, train_loader)
            test_loss = self.test(model, test_loader)
            print(f"rank {self.global_rank}: epoch {epoch} test loss {test_loss:.6f}")
        self.save({"model": model, "optimizer": optimizer, "epochs": args.epochs}, args.checkpoint)
        return test_loss

    def train_one_epoch(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> None:
        model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            self.backward(loss)
            optimizer.step()

    def test(self, model: nn.Module, loader: DataLoader) -> float:
        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for images, labels in loader:
                test_loss += F.cross_entropy(model(images), labels, reduction="sum").item()
        test_loss = self.all_reduce(test_loss, reduce_op="sum")  # a tensor on self.device
        return test_loss.item() / len(loader.dataset)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", type=Path, default=Path("mnist_style.ckpt"))
    for choice in ("accelerator", "strategy", "devices", "precision"):
        parser.add_argument(f"--{choice}")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    choices = {k: getattr(args, k) for k in ("accelerator", "strategy", "devices", "precision")}
    MnistStyle(**{k: v for k, v in choices.items() if v is not None}).run(args)
