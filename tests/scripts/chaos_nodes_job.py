"""The elastic chaos job: docs/preemption.md's loop under `strategy="fsdp"` on the nodes of
`lite run --nnodes 1:2` (one rank a node), reading elastic_job.py's stream of global batches
(`split_batches=True`), resumed at the top from `latest(BUCKET)` and saved, sharded, to
`BUCKET/step-N` after every step. It logs its loss at each step, as docs/logging.md shows, to an
MLflow tracking server (`CHAOS_MLFLOW_URI`, experiment `CHAOS_MLFLOW_EXPERIMENT`) and a W&B
offline run (its files under `OUT/wandb`, on the node that hosts global rank 0): both loggers are
in the saved state, so every restart continues the same runs. The harness
(tests/integration/elastic/test_chaos_nodes.py) starts the nodes and lands its faults between steps.

    lite run --nnodes 1:2 ... chaos_nodes_job.py OUT BUCKET

OUT is this node's own folder (nodes share none). What the job keeps there:

- `ledger`: right after each step, before it is logged and saved, a line `epoch step world rank
  pid loss ids...` (the loss this rank computed, as Python writes the float, and the sample ids it
  trained on), flushed and synced: the job's own account, not Lite's (rank 0's loss is the value the
  trackers must hold);
- `worker`: `rank pid` of the rank running now, and `ready-PID` once it has started;
- `held`: `pid step` while it waits between steps because `OUT/hold` names a step it has reached
  (or is empty); SIGTERM ends the wait;
- `gate`: while it exists, a new rank waits before reading the bucket (the harness restarts the
  store meanwhile);
- `pause-save`: the next save's `.metadata` (torch distributed checkpoint writes it last, on rank 0,
  once every rank's shards are in the bucket) is not written: the rank writes `OUT/paused` (its
  pid) and waits to be killed there, so the harness can kill a rank inside a sharded save without
  depending on timing. The hook is a user's own: an fsspec file system registered for `s3`;
- `slow`: while it exists, the rank sleeps `SLOW` seconds after each step (a slow node; the other
  waits for it in the next step's collectives);
- `done.json`: the final weights and world size, once the last step is saved.

On SIGTERM (`lite run` passes it on to every rank) the loop agrees on it with one `all_reduce`,
saves and returns, as the preemption page's loop does.

`CHAOS_PLANT` plants a fault the harness must see: `loggers-not-saved` leaves the loggers out of
the saved state (a restart opens new tracker runs), `wandb-not-at-save` makes `WandbLogger` skip
its durable point at `save` (a checkpoint commits before W&B's files hold the steps it covers),
`orphan` has each rank start a process in a session of its own that outlives the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import GLOBAL_BATCH, Stream, whole  # noqa: E402

torch.set_num_threads(1)
#: 4 epochs of 4 global batches of 8 (elastic_job's 32 samples).
EPOCHS = 4
#: Seconds a slow node's rank sleeps after each step (`OUT/slow`).
SLOW = 0.5


class IdStream(Stream):
    """elastic_job's stream, each sample with its id (its index in `data()`) as a third tensor."""

    def __init__(self) -> None:
        super().__init__()
        x, y = self.samples.tensors
        self.samples = TensorDataset(x, y, torch.arange(len(x)))


def pausing_s3(out: Path) -> type:
    """s3fs's file system, which waits to be killed instead of writing a `.metadata` while
    `OUT/pause-save` exists (once: the file is removed)."""
    from s3fs import S3FileSystem

    class PausingS3(S3FileSystem):
        def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if "w" in mode and path.rsplit("/", 1)[-1].startswith(".metadata"):
                try:
                    (out / "pause-save").unlink()
                except FileNotFoundError:
                    pass
                else:
                    _write(out / "paused", str(os.getpid()))
                    while True:
                        time.sleep(1)
            return super()._open(path, mode, *args, **kwargs)

    return PausingS3


def _write(path: Path, text: str) -> None:
    """Write `path` whole or not at all (the harness polls it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)


def _record(out: Path, epoch: int, step: int, world: int, rank: int, loss: float, ids: torch.Tensor) -> None:
    with open(out / "ledger", "a") as ledger:
        ledger.write(f"{epoch} {step} {world} {rank} {os.getpid()} {loss!r} {' '.join(str(int(i)) for i in ids.tolist())}\n")
        ledger.flush()
        os.fsync(ledger.fileno())


def _held(out: Path, step: int) -> bool:
    try:
        text = (out / "hold").read_text().strip()
    except FileNotFoundError:
        return False
    return not text or step >= int(text)


def main(out: Path, bucket: str) -> None:
    import fsspec

    from lite_core import LightningLite, MLflowLogger, WandbLogger
    from lite_core.checkpoint import latest

    fsspec.register_implementation("s3", pausing_s3(out), clobber=True)
    plant = os.environ.get("CHAOS_PLANT", "")
    if plant == "wandb-not-at-save":
        WandbLogger._persist = lambda self: None  # type: ignore[method-assign]

    class Chaos(LightningLite):
        def run(self) -> None:
            stop = {"requested": False}
            signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
            torch.manual_seed(0)
            model = nn.Linear(4, 1).double()
            model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
            loader = self.setup_dataloaders(DataLoader(IdStream(), batch_size=GLOBAL_BATCH), split_batches=True)
            state = {"model": model, "optimizer": optimizer, "loader": loader, "mlflow": mlflow, "wandb": wandb,
                     "epoch": 0, "step": 0}
            if plant == "loggers-not-saved":
                del state["mlflow"], state["wandb"]
            if plant == "orphan":
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
            _write(out / "worker", f"{self.global_rank} {os.getpid()}")
            (out / f"ready-{os.getpid()}").touch()
            while (out / "gate").exists() and not stop["requested"]:
                time.sleep(0.02)
            resumed = latest(bucket)
            if resumed is not None:
                self.load(resumed, state)
            for epoch in range(state["epoch"], EPOCHS):
                for x, y, ids in loader:
                    optimizer.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    self.backward(loss)
                    optimizer.step()
                    state["step"] += 1
                    state["epoch"] = epoch
                    _record(out, epoch, state["step"], self.world_size, self.global_rank, loss.item(), ids)
                    self.log("loss", loss, step=state["step"])  # global rank 0's, wherever it runs
                    preempted = self.all_reduce(torch.tensor(float(stop["requested"])), reduce_op="max") > 0
                    self.save(state, f"{bucket}/step-{state['step']}")
                    if preempted:
                        _write(out / "preempted", f"{os.getpid()} {state['step']}")
                        return
                    if (out / "slow").exists():
                        time.sleep(SLOW)
                    if _held(out, state["step"]):
                        _write(out / "held", f"{os.getpid()} {state['step']}")
                        while _held(out, state["step"]) and not stop["requested"]:
                            time.sleep(0.02)
                state["epoch"] = epoch + 1
            weights = [whole(p).detach().flatten().tolist() for p in model.parameters()]
            _write(out / "done.json", json.dumps({"weight": weights, "world": self.world_size, "step": state["step"]}))

    mlflow = MLflowLogger(experiment_name=os.environ["CHAOS_MLFLOW_EXPERIMENT"],
                          tracking_uri=os.environ["CHAOS_MLFLOW_URI"], fallback_dir=out, request_timeout=5)
    wandb = WandbLogger(project="chaos", save_dir=out / "wandb", mode="offline")
    Chaos(loggers=[mlflow, wandb]).run()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
