"""Train the CNN with plain PyTorch, on one process. Compare with train_lite.py:

    diff examples/image_classifier/train_plain.py examples/image_classifier/train_lite.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

from data_and_model import make_dataset, make_model


def train(args: argparse.Namespace) -> tuple[float, float]:
    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = DataLoader(make_dataset(2048, seed=1), batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(make_dataset(512, seed=2), batch_size=256)

    for epoch in range(args.epochs):
        model.train()
        for step, (images, labels) in enumerate(train_loader):
            if step == args.max_steps:
                break
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
        accuracy = evaluate(model, val_loader)
        print(f"epoch {epoch + 1}/{args.epochs}  loss {loss.item():.4f}  val accuracy {accuracy:.3f}")
    return loss.item(), accuracy


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += (model(images).argmax(1) == labels).sum().item()
        total += len(labels)
    return correct / total


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps per epoch (-1: all)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


if __name__ == "__main__":
    final_loss, final_accuracy = train(parse_args())
    print(f"final loss {final_loss!r} accuracy {final_accuracy!r}")
