"""A job that leaves every choice to the launcher: `LightningLite()` with no arguments.

    lite run --accelerator cpu --strategy ddp --devices 2 cli_job.py OUT_DIR [MODE]
    lite run ... -m cli_job OUT_DIR [MODE]
    LITE_DEVICES=2 LITE_STRATEGY=ddp torchrun --nproc-per-node=2 cli_job.py OUT_DIR

Each rank trains a tiny model on its shard and writes `OUT_DIR/rank{r}.json`. MODE `explicit`
passes `devices=1, precision="64-true"` in code instead (to test precedence); MODE `devices3`
passes `devices=3` in code (which `lite run --devices 2` refuses); MODE `fail1` makes
rank 1 exit with code 7 while rank 0 waits in a collective; MODE `hang` waits forever after
writing `OUT_DIR/ready_rank{r}`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

torch.set_num_threads(1)
_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "LITE_ACCELERATOR", "LITE_STRATEGY", "LITE_DEVICES", "LITE_NUM_NODES", "LITE_PRECISION")


class Job(LightningLite):
    def run(self, out_dir: str, mode: str) -> dict:
        rank = self.global_rank
        Path(out_dir, f"ready_rank{rank}").write_text(str(os.getpid()))
        if mode == "hang":
            time.sleep(600)
        if mode == "fail1":
            if rank == 1:
                time.sleep(0.3)
                os._exit(7)
            self.all_reduce(torch.ones(1))
        self.seed_everything(3)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = self.setup(model, optimizer)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
        losses = []
        for _ in range(3):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(xb), yb.to(model.weight.dtype))
                self.backward(loss)
                optimizer.step()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        record = {
            "pid": os.getpid(), "ppid": os.getppid(), "global_rank": rank, "local_rank": self.local_rank,
            "node_rank": self.node_rank, "world_size": self.world_size, "strategy": self.strategy.name,
            "accelerator": self.strategy.accelerator.name, "precision": self._plan.precision.name,
            "losses": losses, "weight": model.weight.detach().double().flatten().tolist(),
            "env": {name: os.environ.get(name) for name in _ENV},
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        return record


def main() -> None:
    out_dir = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "default"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = Job(precision="64-true") if mode == "explicit" else Job(devices=3) if mode == "devices3" else Job()
    for warning in caught:
        # One write per line: print() writes the text and the newline separately, and two ranks
        # sharing the pipe can then interleave their lines.
        sys.stderr.write(f"WARNING {warning.filename}:{warning.lineno}: {warning.message}\n")
    job.run(out_dir, mode)


if __name__ == "__main__":
    main()
