"""A 2-process job that checkpoints after every epoch and resumes at the top of `run()`, so that
`lite run --max-restarts N` makes a rank's death invisible.

    lite run --max-restarts 1 --accelerator cpu --devices 2 restart_job.py OUT_DIR HOW

HOW says how rank 1 dies in the middle of the second epoch: `exit` (`os._exit(3)`) on the first
attempt only (OUT_DIR/died marks that it did), or `sigkill-then-raise`: SIGKILL to itself on the
first attempt, an error on every later one. Each rank prints a line per epoch, and each rank that
finishes writes OUT_DIR/rank{r}.json with its final weights and the attempt
(`LITE_RESTART_COUNT`) it finished in.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

torch.set_num_threads(1)
EPOCHS = 3


def data() -> TensorDataset:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True) + 1)


def die(out_dir: Path, how: str) -> None:
    if (out_dir / "died").exists():
        if how == "sigkill-then-raise":
            raise RuntimeError("rank 1 fails again after the restart")
        return
    (out_dir / "died").touch()
    if how == "sigkill-then-raise":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


class Resumable(LightningLite):
    def run(self, out_dir: str, how: str) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).double()
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        loader = self.setup_dataloaders(DataLoader(data(), batch_size=4))
        checkpoint = Path(out_dir, "last.ckpt")
        state = {"epoch": 0, "model": model, "optimizer": optimizer}
        self.load(checkpoint, state, missing_ok=True)  # the one line that makes a restart invisible
        for epoch in range(state["epoch"], EPOCHS):
            for step, (x, y) in enumerate(loader):
                if epoch == 1 and step == 1 and self.global_rank == 1:
                    die(Path(out_dir), how)
                optimizer.zero_grad()
                self.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            print(f"rank {self.global_rank} finished epoch {epoch}", flush=True)
            state["epoch"] = epoch + 1
            self.save(state, checkpoint)
        record = {"weight": [p.detach().flatten().tolist() for p in model.parameters()],
                  "restart": os.environ.get("LITE_RESTART_COUNT")}
        Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    Resumable().run(sys.argv[1], sys.argv[2])
