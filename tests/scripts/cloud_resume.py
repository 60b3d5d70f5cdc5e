"""A 2-process job that keeps its checkpoints only in a bucket and resumes at the top of `run()`
from the latest complete one (`lite_core.checkpoint.latest`), so that `lite run --max-restarts 1`
makes a rank's death invisible without any shared folder.

    lite run --max-restarts 1 --accelerator cpu --devices 2 cloud_resume.py BASE OUT_DIR HOW

(or one process on each of two `lite run` nodes, each with an OUT_DIR of its own). BASE: an
`s3://bucket/run` prefix (the S3 client is set up by the environment). HOW: `die` makes rank 1
exit in the middle of the second epoch on the attempt that started from scratch only
(OUT_DIR/died marks that it did); `preempt` makes every rank leave with exit code 143 (as a
preempted job's processes do on SIGTERM) once the checkpoint of the first epoch is saved, on an
attempt that started from scratch (OUT_DIR/preempted marks it); `live` runs through. Each rank writes OUT_DIR/rank{r}.json with
its final weights, the checkpoint it resumed from, the epoch it started at and the attempt
(`LITE_RESTART_COUNT`) it finished in.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.checkpoint import latest

torch.set_num_threads(1)
EPOCHS = 3


def data() -> TensorDataset:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True) + 1)


class FromTheBucket(LightningLite):
    def run(self, base: str, out_dir: str, how: str) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).double()
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        loader = self.setup_dataloaders(DataLoader(data(), batch_size=4))
        state = {"epoch": 0, "model": model, "optimizer": optimizer}
        resumed_from = latest(base)  # the two lines that resume from the store
        if resumed_from is not None:
            self.load(resumed_from, state)
        started_at = state["epoch"]
        for epoch in range(state["epoch"], EPOCHS):
            for step, (x, y) in enumerate(loader):
                # Only an attempt that started from scratch dies: each node counts its own
                # restarts (a node restarted only because the other's rank died counts none).
                if how == "die" and epoch == 1 and step == 1 and self.global_rank == 1 and resumed_from is None:
                    Path(out_dir, "died").touch()
                    os._exit(3)
                optimizer.zero_grad()
                self.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            state["epoch"] = epoch + 1
            self.save(state, f"{base}/epoch-{epoch + 1}")
            if how == "preempt" and epoch == 0 and resumed_from is None:
                Path(out_dir, "preempted").touch()
                os._exit(143)
        record = {"weight": [p.detach().flatten().tolist() for p in model.parameters()],
                  "resumed_from": os.path.basename(resumed_from or ""), "started_at": started_at,
                  "restart": os.environ.get("LITE_RESTART_COUNT")}
        Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    FromTheBucket().run(*sys.argv[1:4])
