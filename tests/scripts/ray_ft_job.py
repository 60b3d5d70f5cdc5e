"""A user's ordinary `strategy="ddp_ft"` script as a Ray Train `train_loop_per_worker`, for a
`TorchTrainer(..., torch_config=TorchftConfig(...))`: it names no replica group, no rank and no
process count. Each replica group that finishes writes its weights to
`OUT_DIR/weights-<pid>.pt`; `plain()` is the same loop in one plain PyTorch process.

With `config["die"]` the test's harness (not the user's loop) has Ray worker 1 end its process
after its second committed step on the first attempt (`OUT_DIR/died` marks it), and the survivor
wait between steps until Ray's replacement is set up and asking for its first quorum
(`OUT_DIR/back-<pid>`), so that the replacement heals from it; every committed step appends `<pid> <step>` to `OUT_DIR/steps`.
On the first attempt both workers wait for each other before their loops (`OUT_DIR/ready-<worker>`), so
that they meet in their first quorum.
"""

from __future__ import annotations

import os
import time
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

    out = Path(config["out_dir"])
    harness = _Harness(out) if config.get("die") else None

    class Train(LightningLite):
        def run(self) -> None:
            net = _model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
            loader = self.setup_dataloaders(_data(), split_batches=True)
            if harness:
                harness.before_loop()
            for x, y in loader:
                optimizer.zero_grad()
                self.backward(torch.nn.functional.mse_loss(net(x), y))
                optimizer.step()
                if harness:
                    harness.after_step(self.strategy.step)
            if self.global_rank == 0:
                torch.save(net.state_dict(), out / f"weights-{os.getpid()}.pt")

    Train(accelerator="cpu", strategy="ddp_ft").run()


class _Harness:
    """The test's hand in the run: the death of Ray worker 1 and the survivor's wait for its replacement."""

    def __init__(self, out: Path) -> None:
        import ray.train

        self.out, self.worker = out, ray.train.get_context().get_world_rank()

    def before_loop(self) -> None:
        if self.worker == 1 and (self.out / "died").exists():  # Ray's replacement, about to ask for its first quorum
            (self.out / f"back-{os.getpid()}").touch()
            return
        # First attempt: both workers set up (their Managers heartbeat) before either asks for a quorum, so
        # the first quorum holds both. Without it, a worker set up seconds before the other on a busy
        # machine trained its steps alone and died before the other came.
        (self.out / f"ready-{self.worker}").touch()
        while not all((self.out / f"ready-{worker}").exists() for worker in (0, 1)):
            time.sleep(0.05)

    def after_step(self, step: int) -> None:
        with open(self.out / "steps", "a") as record:
            record.write(f"{os.getpid()} {step}\n")
        if self.worker == 1 and step == 2 and not (self.out / "died").exists():
            (self.out / "died").touch()
            os._exit(3)
        if (self.out / "died").exists() and not list(self.out.glob("back-*")):
            while not list(self.out.glob("back-*")):
                time.sleep(0.05)  # the survivor goes on once the replacement is there to heal from it
            time.sleep(1.0)  # and is waiting at the lighthouse, so that the next quorum holds both
