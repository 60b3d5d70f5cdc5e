"""Gradient accumulation: one optimizer step per GLOBAL batch, computed in micro-batches, with
the gradient all-reduced once per step instead of once per micro-batch.

    python examples/gradient_accumulation.py                      # 1 process: 4 micro-batches of 2 per step
    python examples/gradient_accumulation.py --strategy ddp --devices 2   # 2 processes: 2 each

Every step sees the same 8 samples whatever the number of processes, so the final loss is the same
as one plain PyTorch process taking batches of 8 (`--plain` runs that loop).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 8, 2, 6, 0.05


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * STEPS, 4, generator=generator)
    return TensorDataset(x, torch.tanh(x.sum(dim=1, keepdim=True)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


class Train(LightningLite):
    def run(self) -> float:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = self.setup(model, optimizer)
        loader = self.setup_dataloaders(DataLoader(make_data(), batch_size=MICRO_BATCH))
        accumulate = GLOBAL_BATCH // (MICRO_BATCH * self.world_size)  # micro-batches per step and process
        self.print(f"{self.world_size} process(es), {accumulate} micro-batch(es) of {MICRO_BATCH} per step")
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accumulate == 0
            # No gradient all-reduce until the last micro-batch of the step (the gradients add up locally).
            with self.no_backward_sync(model, enabled=not last):
                loss = nn.functional.mse_loss(model(x), y)
                self.backward(loss / accumulate)  # the mean over the step's samples, as one batch of 8
            if last:
                optimizer.step()
                optimizer.zero_grad()
        return final_loss(model)


def plain() -> float:
    """The same training in plain PyTorch on one process, one batch of GLOBAL_BATCH per step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in DataLoader(make_data(), batch_size=GLOBAL_BATCH):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return final_loss(model)


def final_loss(model: nn.Module) -> float:
    x, y = make_data().tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help="run the plain PyTorch loop instead")
    args = parser.parse_args()
    if args.plain:
        print(f"final loss {plain():.8f}")
        return
    lite = Train(accelerator="cpu", strategy=args.strategy, devices=args.devices)
    loss = lite.run()
    if lite.is_global_zero:
        print(f"final loss {loss:.8f}")


if __name__ == "__main__":
    main()
