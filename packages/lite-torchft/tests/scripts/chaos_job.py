"""The chaos job: docs/preemption.md's loop as a cloud user runs it under `ddp_ft` (one replica
group of one process; the harness, tests/_chaos.py, starts two and injects the faults).

    python chaos_job.py OUT BUCKET        # one group (REPLICA_GROUP_ID etc. in the environment)
    python chaos_job.py OUT plain         # the same loop in plain PyTorch: OUT/weights-plain.pt

The data is a Hugging Face `datasets` stream read from the bucket's server (`CHAOS_STREAM`: the
URL of a folder of JSON-lines files that the harness wrote, `write_stream`), through a shuffle
buffer seeded by the epoch. Two epochs of it (`split_batches=True`: each loader batch is the
step's global batch, which the groups alive in the step split), the set-up loader in the saved
state, resumed at the top from `latest(BUCKET)`, saved to `BUCKET/step-N` after every committed
step (every other one in the background), stopped on SIGTERM with a last foreground save. The job
keeps its own ledger: right after each committed step, before saving, a line `epoch step pid
rows...` (the sample ids this process trained on) goes to `OUT/ledger-<group>`, flushed and
synced. It also logs the sum of its step's sample ids as `batch` at the committed step to three
trackers, each part of the saved state as docs/logging.md shows and each holding one run for the
job through LITE_JOB_ID: a `TrackioLogger` (project `chaos`, its store in TRACKIO_DIR), an
`MLflowLogger` (the server at `CHAOS_MLFLOW_URI`, experiment `CHAOS_MLFLOW_EXPERIMENT`) and a
`WandbLogger` offline (its files under `OUT/wandb`). Between steps the group waits while
`OUT/hold-<group>` names a step it has reached (the harness lands its faults there), and at the
start while `OUT/gate` exists; while `OUT/slow-<group>` exists it sleeps 10 times longer between
steps (a slow rank). A finished group writes `OUT/weights-<group>.pt` and `OUT/done-<group>`; a
preempted one returns after its last save without them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ft_train import _held  # the same hold between steps as the heal tests' script

EPOCHS = 2
BATCH = 4  # the global batch
SAMPLES = 48  # 12 steps an epoch
SLEEP = float(os.environ.get("CHAOS_STEP_SLEEP", "0.05"))


def stream() -> Any:
    """The Hugging Face stream of `CHAOS_STREAM`'s files, shuffled through a buffer of 8 rows whose
    seed is 0 plus the epoch (`set_epoch`), as torch tensors."""
    import datasets

    datasets.disable_progress_bars()
    files = datasets.load_dataset("json", data_files=f"{os.environ['CHAOS_STREAM']}/part-*.jsonl", split="train",
                                  streaming=True)
    return files.shuffle(seed=0, buffer_size=8).with_format("torch")


def unpack(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stream batch as (x, y, sample ids)."""
    return batch["x"].float(), batch["y"].float().unsqueeze(1), batch["id"]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def plain(out: Path) -> None:
    """One plain PyTorch process reading the same stream: where a job without faults ends."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = stream()
    loader = DataLoader(data, batch_size=BATCH)
    for epoch in range(EPOCHS):
        data.set_epoch(epoch)
        for batch in loader:
            x, y, _ = unpack(batch)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    torch.save(net.state_dict(), out / "weights-plain.pt")


def _record(out: Path, group: str, epoch: int, step: int, index: torch.Tensor) -> None:
    rows = " ".join(str(int(i)) for i in index.flatten().tolist())
    with open(out / f"ledger-{group}", "a") as ledger:
        ledger.write(f"{epoch} {step} {os.getpid()} {rows}\n")
        ledger.flush()
        os.fsync(ledger.fileno())


def lite(out: Path, bucket: str) -> None:
    from lite_core import LightningLite, MLflowLogger, TrackioLogger, WandbLogger
    from lite_core.checkpoint import latest
    from lite_torchft import DDPFTStrategy

    group = os.environ["REPLICA_GROUP_ID"]

    class Train(LightningLite):
        def run(self) -> None:
            stop = {"requested": False}
            signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))  # the scheduler's warning
            net = model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
            loader = self.setup_dataloaders(DataLoader(stream(), batch_size=BATCH), split_batches=True)
            state = {"model": net, "optimizer": optimizer, "loader": loader, "tracker": tracker, "mlflow": mlflow,
                     "wandb": wandb, "epoch": 0, "step": 0}
            resumed = latest(bucket)
            if resumed is not None:
                self.load(resumed, state)
            (out / f"ready-{group}-{os.getpid()}").touch()
            while (out / "gate").exists():
                time.sleep(0.02)
            for epoch in range(state["epoch"], EPOCHS):
                for batch in loader:
                    x, y, index = unpack(batch)
                    optimizer.zero_grad()
                    self.backward(torch.nn.functional.mse_loss(net(x), y))
                    before = self.strategy.step
                    optimizer.step()
                    if self.strategy.step == before:
                        continue  # the step did not commit: its batch comes again
                    state["step"], state["epoch"] = self.strategy.step, epoch
                    _record(out, group, epoch, state["step"], index)
                    self.log("batch", float(index.sum()), step=state["step"])  # from the group that logs
                    if self.all_reduce(torch.tensor(float(stop["requested"])), reduce_op="max") > 0:
                        self.save(state, f"{bucket}/step-{state['step']}")
                        return
                    self.save(state, f"{bucket}/step-{state['step']}", blocking=state["step"] % 2 == 0)
                    time.sleep(SLEEP * (10 if (out / f"slow-{group}").exists() else 1))
                    while _held(out, group, state["step"]):
                        time.sleep(0.02)
                state["epoch"] = epoch + 1
            weights = {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}
            self.save(state, f"{bucket}/step-{state['step']}")  # waits for the last background save too
            torch.save(weights, out / f"weights-{group}.pt")
            (out / f"done-{group}").touch()

    import trackio.run

    # trackio's client writes its rows every half second; W&B offline's every 15 s. At an hour only the
    # logger's write at `save` makes a logged step durable before a kill, which is what this job checks.
    trackio.run.BATCH_SEND_INTERVAL = 3600.0
    tracker = TrackioLogger(project="chaos")
    mlflow = MLflowLogger(experiment_name=os.environ["CHAOS_MLFLOW_EXPERIMENT"],
                          tracking_uri=os.environ["CHAOS_MLFLOW_URI"], fallback_dir=out, request_timeout=5)
    wandb = WandbLogger(project="chaos", save_dir=out / "wandb", mode="offline")
    Train(accelerator="cpu", strategy=DDPFTStrategy(ft_timeout=5), loggers=[tracker, mlflow, wandb]).run()


if __name__ == "__main__":
    if sys.argv[2] == "plain":
        plain(Path(sys.argv[1]))
    else:
        lite(Path(sys.argv[1]), sys.argv[2])
