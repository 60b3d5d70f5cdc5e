"""`fsdp` on the fake backend's device (tests/fake_backend), which the core names nowhere: a new
device that declares a `torch.distributed` backend trains under the core's sharded strategy.

    LITE_FAKE_AVAILABLE=1 python fake_device_fsdp.py

Prints `OK fsdp on fake` after two optimizer steps that changed the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from lite_core import LightningLite


class Train(LightningLite):
    def run(self) -> None:
        assert self.strategy.accelerator.name == "fake" and self.strategy.name == "fsdp"
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        before = model.weight.detach().clone()
        model = self.setup_module(model)
        optimizer = self.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):
            optimizer.zero_grad()
            self.backward(model(torch.ones(3, 4)).sum())
            optimizer.step()
        after = self.all_gather(model.weight.full_tensor().detach())[0]
        assert not torch.equal(before, after)
        print("OK fsdp on fake")


if __name__ == "__main__":
    Train(accelerator="fake", strategy="fsdp", devices=1).run()
