"""A job for two "nodes" on one machine, each started by its own `lite run`, that names no process
count: it keeps a global batch of 8 by sizing each rank's batch from `self.world_size`, saves
after every epoch and resumes at the top of `run()`, so that it ends with the same weights
whether it ran uninterrupted, restarted, or lost a node and went on alone.

    lite run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT elastic_nodes_job.py OUT_DIR HOW

HOW says what global rank 1 does in the middle of the second epoch: `none` (nothing), `die-once`
(`os._exit(3)` on the first attempt only; OUT_DIR/died marks that it did), or `wait-to-be-killed`
(writes OUT_DIR/waiting and sleeps until its node is killed). Each rank that finishes writes
OUT_DIR/rank{r}.json with its final weights, the world size and the attempt it finished in.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

torch.set_num_threads(1)
EPOCHS = 3
GLOBAL_BATCH = 8


def data() -> TensorDataset:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True) + 1)


def act(out_dir: Path, how: str) -> None:
    if how == "die-once" and not (out_dir / "died").exists():
        (out_dir / "died").touch()
        os._exit(3)
    if how == "wait-to-be-killed":
        (out_dir / "waiting").write_text(str(os.getpid()))
        time.sleep(600)


class Elastic(LightningLite):
    def run(self, out_dir: str, how: str) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).double()
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        loader = self.setup_dataloaders(DataLoader(data(), batch_size=GLOBAL_BATCH // self.world_size))
        checkpoint = Path(out_dir, "last.ckpt")
        state = {"epoch": 0, "model": model, "optimizer": optimizer}
        self.load(checkpoint, state, missing_ok=True)
        for epoch in range(state["epoch"], EPOCHS):
            for step, (x, y) in enumerate(loader):
                if epoch == 1 and step == 1 and self.global_rank == 1:
                    act(Path(out_dir), how)
                optimizer.zero_grad()
                self.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            state["epoch"] = epoch + 1
            self.save(state, checkpoint)
        record = {"weight": [p.detach().flatten().tolist() for p in model.parameters()],
                  "world_size": self.world_size, "restart": os.environ.get("LITE_RESTART_COUNT")}
        Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    Elastic(accelerator="cpu").run(sys.argv[1], sys.argv[2])
