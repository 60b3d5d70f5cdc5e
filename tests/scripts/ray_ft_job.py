"""A user's ordinary `strategy="ddp_ft"` script as a Ray Train `train_loop_per_worker`, for a
`TorchTrainer(..., torch_config=TorchftConfig(...))`: it names no replica group, no rank and no
process count. Each replica group that finishes writes its weights to
`OUT_DIR/weights-<pid>.pt`; `plain()` is the same loop in one plain PyTorch process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

STEPS = 6
GLOBAL_BATCH = 4


def _data() -> DataLoader:
    x = torch.randn(STEPS * GLOBAL_BATCH, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]])), batch_size=GLOBAL_BATCH)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def plain() -> dict[str, torch.Tensor]:
    """The weights of the same loop run in one plain PyTorch process."""
    net = _model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for x, y in _data():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return net.state_dict()


def train(config: dict[str, Any]) -> None:
    from lite_core import LightningLite

    class Train(LightningLite):
        def run(self) -> None:
            net = _model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
            loader = self.setup_dataloaders(_data(), split_batches=True)
            for x, y in loader:
                optimizer.zero_grad()
                self.backward(torch.nn.functional.mse_loss(net(x), y))
                optimizer.step()
            if self.global_rank == 0:
                torch.save(net.state_dict(), Path(config["out_dir"]) / f"weights-{os.getpid()}.pt")

    Train(accelerator="cpu", strategy="ddp_ft").run()
