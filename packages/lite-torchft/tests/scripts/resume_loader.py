"""A user's loop with the set-up loader in the saved state, as docs/preemption.md writes it, under
`ddp_ft` or `diloco` (one replica group of one process; the lighthouse's address is in the environment).

    python resume_loader.py STRATEGY SHUFFLE OUT [STOP]

Trains two epochs over 10 samples (batch 1; SHUFFLE `stream`: an `IterableDataset` whose order
depends on its epoch, as a Hugging Face stream's shuffle buffer does); with STOP, saves at that step and exits, as a job that
was preempted; without it, resumes from OUT if it exists. Prints `SEEN <json list of samples>`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lite_core import LightningLite

SHUFFLE = {
    "none": dict,
    "generator": lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(0)},
    "default": lambda: {"shuffle": True},  # torch's default generator
}


class Samples(IterableDataset):
    """The samples 0..9 as `(tensor,)`, in an order drawn from the epoch (`set_epoch`)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(self.epoch))
        return iter([(value.float().reshape(1),) for value in order])


def strategy_for(name: str) -> Any:
    if name == "diloco":
        from lite_torchft.diloco import DiLoCoStrategy

        return DiLoCoStrategy(sync_every=3)
    from lite_torchft import DDPFTStrategy

    return DDPFTStrategy(ft_timeout=5)


def train(lite: LightningLite, shuffle: str, path: str, stop: int | None) -> list[int]:
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    net, optimizer = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    if shuffle == "stream":
        loader = lite.setup_dataloaders(DataLoader(Samples(), batch_size=1))
    else:
        data = TensorDataset(torch.arange(10.0).unsqueeze(1))
        loader = lite.setup_dataloaders(DataLoader(data, batch_size=1, **SHUFFLE[shuffle]()))
    state = {"model": net, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0}
    if stop is None and os.path.exists(path):
        lite.load(path, state)
    seen = []
    for epoch in range(state["epoch"], 2):
        for (x,) in loader:
            seen.append(int(x))
            lite.backward(net(x).sum())
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] == stop:
                lite.save(state, path)
                return seen
        state["epoch"] = epoch + 1
    return seen


if __name__ == "__main__":
    name, shuffle, out = sys.argv[1:4]
    stop = int(sys.argv[4]) if len(sys.argv) > 4 else None
    strategy = strategy_for(name)
    try:
        seen = LightningLite(accelerator="cpu", strategy=strategy).launch(train, shuffle, out, stop)
    finally:
        strategy.teardown()
    print("SEEN " + json.dumps(seen), flush=True)
