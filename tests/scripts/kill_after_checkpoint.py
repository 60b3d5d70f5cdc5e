"""A one-process job SIGKILLed two steps after a checkpoint that holds its loggers, then resumed from it.

    python kill_after_checkpoint.py OUT_DIR LOGGER...

LOGGER is `csv` (OUT_DIR/csv, rows written every 100 steps), `tensorboard` (OUT_DIR/tb), `wandb`
(offline, OUT_DIR/wandb), `trackio` (project `kill`, in TRACKIO_DIR) or `mlflow=URI` (experiment
`kill`, sent every 1000 values). Each step logs `value` (the step, plus 1000 on the resumed attempt)
and, in a second call at the same step, `attempt` (0, then 1). The first attempt saves the model and
its loggers at step CHECKPOINT and SIGKILLs itself right after logging step CHECKPOINT + 2; started
again with the same arguments, it loads the checkpoint and logs steps CHECKPOINT + 1 to STEPS - 1.
Nothing is finalized before the kill: what the checkpoint covers must be in each logger's storage
by the time `save` returns.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lite_core import LightningLite

torch.set_num_threads(1)
STEPS = 16
CHECKPOINT = 10


def make_logger(spec: str, out_dir: Path) -> Any:
    kind, _, uri = spec.partition("=")
    if kind == "csv":
        from lite_core import CSVLogger
        return CSVLogger(out_dir / "csv")
    if kind == "tensorboard":
        from lite_core import TensorBoardLogger
        return TensorBoardLogger(out_dir / "tb")
    if kind == "wandb":
        from lite_core import WandbLogger
        return WandbLogger(project="kill", save_dir=out_dir / "wandb", mode="offline")
    if kind == "trackio":
        from lite_core import TrackioLogger
        return TrackioLogger(project="kill")
    if kind == "mlflow":
        from lite_core import MLflowLogger
        return MLflowLogger(experiment_name="kill", tracking_uri=uri, flush_every=1000, fallback_dir=out_dir)
    raise SystemExit(f"unknown logger {spec!r}")


class KilledJob(LightningLite):
    def run(self, out_dir: Path, loggers: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        checkpoint = out_dir / "last.ckpt"
        attempt = 1 if checkpoint.exists() else 0
        state = {"step": 0, "model": model, "optimizer": optimizer, **loggers}
        self.load(checkpoint, state, missing_ok=True)
        for step in range(state["step"], STEPS):
            optimizer.zero_grad()
            self.backward(model(torch.randn(4, 2)).pow(2).mean())
            optimizer.step()
            self.log("value", step + 1000.0 * attempt, step=step)
            self.log("attempt", float(attempt), step=step)
            if step == CHECKPOINT:
                state["step"] = step + 1
                self.save(state, checkpoint)
            if attempt == 0 and step == CHECKPOINT + 2:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out_dir = Path(sys.argv[1])
    loggers = {spec.partition("=")[0]: make_logger(spec, out_dir) for spec in sys.argv[2:]}
    KilledJob(accelerator="cpu", loggers=list(loggers.values())).run(out_dir, loggers)


if __name__ == "__main__":
    main()
