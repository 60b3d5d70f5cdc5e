"""A 2-process job that logs to W&B (offline), MLflow and trackio (its local store) from every
rank, checkpoints its loggers with the model every 2 steps and resumes at the top of `run()`; rank
1 dies on the first attempt.

    TRACKIO_DIR=... lite run --max-restarts 1 --accelerator cpu --nproc-per-node 2 --standalone \
        trackers_job.py OUT_DIR MLFLOW_URI [PROJECT]

Every rank logs `value` = step + 100 * rank at steps 0..7 (through `self.log`), its config (through
`self.log_hyperparams`, before the `load`) and `OUT_DIR/summary-rank{r}.txt` as an artifact (on the
loggers directly). On the first attempt rank 0 sends step 4 to MLflow (`flush()`) and finishes its
W&B and trackio runs (`finalize()`, so that their writers store them before the kill), then the job
is preempted after step 4 (every rank `os._exit(3)`), so the restart resumes from the checkpoint of
step 3 and repeats step 4. A `ThroughputMonitor` logs a row at steps 2, 4 and 6 (each attempt's monitor once it has
measured two steps), each with the checkpoints' stall since the row before and the restarts. W&B
writes under OUT_DIR/wandb, trackio under TRACKIO_DIR; what MLflow could not take would go to
OUT_DIR. PROJECT (default `lite-test`) names the W&B project, MLflow experiment and trackio project.
Started again without `--max-restarts` after the preemption (with `OUT_DIR/died` and the checkpoint
there), it resumes from the checkpoint at whatever world size it is given.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
from torch import nn

from lite_core import LightningLite, MLflowLogger, ThroughputMonitor, TrackioLogger, WandbLogger

torch.set_num_threads(1)
STEPS = 8


@dataclasses.dataclass
class Config:
    lr: float = 0.05
    optimizer: dict = dataclasses.field(default_factory=lambda: {"name": "sgd", "momentum": 0.0})


class TrackedJob(LightningLite):
    def run(self, out_dir: str, wandb: WandbLogger, mlflow: MLflowLogger, trackio: TrackioLogger) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=Config.lr))
        self.log_hyperparams(Config())
        checkpoint = Path(out_dir, "last.ckpt")
        state = {"step": 0, "model": model, "optimizer": optimizer, "wandb": wandb, "mlflow": mlflow,
                 "trackio": trackio}
        self.load(checkpoint, state, missing_ok=True)
        monitor = ThroughputMonitor(self, log_every_n_steps=2)  # its rows go to the trackers too
        for step in range(state["step"], STEPS):
            optimizer.zero_grad()
            self.backward(model(torch.randn(2, 4)).pow(2).mean())
            optimizer.step()
            self.log("value", step + 100.0 * self.global_rank, step=step)
            monitor.step(batch_size=2, step=step)  # rows at the steps this loop logs at
            if step % 2 == 1:
                state["step"] = step + 1
                self.save(state, checkpoint)
            if step == 4 and not Path(out_dir, "died").exists():
                mlflow.flush()  # the server holds step 4, which the restart repeats
                # W&B offline writes what its service holds to disk only at finish: a job killed
                # before then loses it (seen under load: the first attempt's file held no step).
                wandb.finalize()
                trackio.finalize()  # the same for trackio's writer thread (neither may log again)
                if self.global_rank == 0:
                    Path(out_dir, "died").touch()
                self.barrier()
                os._exit(3)  # the job is preempted: every rank dies
        summary = Path(out_dir, f"summary-rank{self.global_rank}.txt")
        summary.write_text(f"rank {self.global_rank} finished\n")
        for logger in (wandb, mlflow, trackio):
            logger.log_artifact(summary)  # on every rank: rank 0's alone reaches the tracker
        self.barrier()


def main() -> None:
    out_dir, uri = sys.argv[1], sys.argv[2]
    project = sys.argv[3] if len(sys.argv) > 3 else "lite-test"
    wandb = WandbLogger(project=project, save_dir=Path(out_dir, "wandb"), mode="offline")
    mlflow = MLflowLogger(experiment_name=project, tracking_uri=uri, flush_every=3, fallback_dir=out_dir)
    trackio = TrackioLogger(project=project)  # its store: TRACKIO_DIR, set by the test
    TrackedJob(loggers=[wandb, mlflow, trackio]).run(out_dir, wandb, mlflow, trackio)


if __name__ == "__main__":
    main()
