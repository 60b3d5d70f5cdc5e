"""Train the CNN with Lite: the loop of train_plain.py, with the hardware chosen by arguments.

    python examples/image_classifier/train_lite.py --strategy ddp --devices 2
    lite run --strategy ddp --devices 2 examples/image_classifier/train_lite.py
    python examples/image_classifier/train_lite.py          # one process, bit for bit train_plain.py

Choices not given here are left to `lite run` (or LITE_* variables), else Lite's defaults.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

from data_and_model import make_dataset, make_model
from lite_core import LightningLite


class ImageClassifier(LightningLite):
    def run(self, args: argparse.Namespace) -> tuple[float, float]:
        self.seed_everything(args.seed)
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        model, optimizer = self.setup(model, optimizer)
        train_loader = DataLoader(make_dataset(2048, seed=1), batch_size=args.batch_size, shuffle=True)
        val_loader = DataLoader(make_dataset(512, seed=2), batch_size=256)
        train_loader, val_loader = self.setup_dataloaders(train_loader, val_loader)
        self.print(f"training on {self.world_size} process(es), strategy {self.strategy.name}")

        for epoch in range(args.epochs):
            model.train()
            for step, (images, labels) in enumerate(train_loader):
                if step == args.max_steps:
                    break
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(images), labels)
                self.backward(loss)
                optimizer.step()
            accuracy = self.evaluate(model, val_loader)
            loss_value = self.all_reduce(loss.detach()).item()
            self.print(f"epoch {epoch + 1}/{args.epochs}  loss {loss_value:.4f}  val accuracy {accuracy:.3f}")
        return loss_value, accuracy

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: DataLoader) -> float:
        model.eval()
        correct = torch.zeros(2)
        for images, labels in loader:
            correct += torch.tensor([(model(images).argmax(1) == labels).sum().item(), len(labels)])
        correct = self.all_reduce(correct, reduce_op="sum")  # over every rank's shard
        return (correct[0] / correct[1]).item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps per epoch (-1: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    for choice in ("accelerator", "strategy", "devices", "precision"):
        parser.add_argument(f"--{choice}")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    choices = {k: getattr(args, k) for k in ("accelerator", "strategy", "devices", "precision")}
    lite = ImageClassifier(**{k: v for k, v in choices.items() if v is not None})
    final_loss, final_accuracy = lite.run(args)
    if lite.is_global_zero:
        print(f"final loss {final_loss!r} accuracy {final_accuracy!r}")
