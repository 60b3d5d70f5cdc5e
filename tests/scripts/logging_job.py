"""A 2-process `ddp` job that logs, calls callbacks and draws a progress bar on every rank.

    python logging_job.py OUT_DIR

Every rank logs rank-dependent values to a CSVLogger (`OUT_DIR/csv`) and a TensorBoardLogger
(`OUT_DIR/tb`), calls `on_step` on its callbacks (which write `OUT_DIR/callbacks_rank{r}.jsonl`)
and iterates a progress bar described `bar-rank{r}`. Right after `run()` returns, each process
writes `OUT_DIR/after_run_rank{r}.json` with what the loggers had put on disk by then.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lite_core import CSVLogger, LightningLite, TensorBoardLogger, progress_bar

torch.set_num_threads(1)


class StepRecorder:
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_step(self, lite: LightningLite, step: int, *, value: float) -> None:
        with Path(self.out_dir, f"callbacks_rank{lite.global_rank}.jsonl").open("a") as handle:
            handle.write(json.dumps({"rank": lite.global_rank, "step": step, "value": value}) + "\n")


class OnlyEpochs:
    def on_epoch_end(self) -> None:  # no on_step: call("on_step") skips this callback
        raise AssertionError("not called in this job")


class LoggingJob(LightningLite):
    def run(self) -> None:
        rank = self.global_rank
        for step in progress_bar(range(5), self, desc=f"bar-rank{rank}"):
            value = 10.0 * rank + step
            self.log_dict({"loss": torch.tensor(value), "lr": 0.1 * (rank + 1)}, step=step)
            if step == 3:
                self.log("val_acc", 0.5 + rank, step=step)  # a column that appears late
            self.call("on_step", self, step, value=value)
        self.barrier()


def on_disk(out_dir: Path) -> dict:
    files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())
    csv_files = list((out_dir / "csv").rglob("metrics.csv"))
    events = list((out_dir / "tb").rglob("events.out.tfevents.*"))
    return {"files": files, "csv": csv_files[0].read_text() if csv_files else None,
            "event_bytes": sum(p.stat().st_size for p in events)}


def main() -> None:
    out_dir = Path(sys.argv[1])
    loggers = [CSVLogger(out_dir / "csv", name="job", flush_every=1000), TensorBoardLogger(out_dir / "tb", name="job")]
    lite = LoggingJob(accelerator="cpu", strategy="ddp", devices=2, loggers=loggers,
                      callbacks=[StepRecorder(str(out_dir)), OnlyEpochs()])
    lite.run()
    (out_dir / f"after_run_rank{lite.global_rank}.json").write_text(json.dumps(on_disk(out_dir)))


if __name__ == "__main__":
    main()
