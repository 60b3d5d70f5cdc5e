"""A job for launchers that restart it at any world size: it names no process counts, checkpoints
after every epoch, resumes at the top of `run()`, and sizes its per-rank batch from
`self.world_size` so the global batch stays `GLOBAL_BATCH` however many processes run it; so it
ends with the weights of `reference_weights()` whether it ran uninterrupted, restarted, lost a
node and went on alone, or took in a node that started later.

    torchrun ... elastic_job.py OUT_DIR HOW [SECONDS_PER_STEP]
    lite run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT elastic_job.py OUT_DIR HOW

HOW says what global rank 1 does in the middle of the second epoch (before its second step): `steady` (nothing; the test
may kill a node), `die-once` (`os._exit(3)` on the first attempt only; OUT_DIR/died marks that it
did; in the next attempt rank 1 starts a second after rank 0, so that a group built on the
previous attempt's keys finds rank 1's dead address there), or `wait-to-be-killed` (writes its pid
to OUT_DIR/waiting and sleeps until its node is killed). `wait-for-a-node` is for rank 0 instead:
while it runs alone (world size 1) it writes OUT_DIR/waiting and sleeps there until its agent
stops it to take in a node that started later; at the larger world size it trains on. Every rank
prints `epoch E world W` after each epoch (rank 0 also appends it to OUT_DIR/progress.txt) and
each rank that finishes writes OUT_DIR/rank{r}.json with its final weights, the world size, the
environment's name and the restart it finished in (`LITE_RESTART_COUNT`).

HOW with `+split` (e.g. `wait-to-be-killed+split`): the loader is the user's shuffled
`DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)` set up with `split_batches=True`, and the
job checkpoints (loader included) after every step, so a restart resumes in the middle of the epoch;
it ends with `reference_weights(shuffle=True)`. HOW with `+stream`: the same, over a stream instead
(`DataLoader(Stream(), batch_size=GLOBAL_BATCH)` with `split_batches=True`, the samples through a
shuffle buffer seeded by the epoch); it ends with `reference_weights(stream=True)`.

With ELASTIC_JOB_CHECKPOINT set (a URL such as `s3://bucket/run/last`), the checkpoint goes there
instead of OUT_DIR/last.ckpt: nodes that share no folder resume from the store alone. Each rank's
record then also names the step its attempt resumed at (`resumed_step`, 0 for a fresh start).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lite_core import LightningLite

torch.set_num_threads(1)
EPOCHS = 3
GLOBAL_BATCH = 8


def data() -> TensorDataset:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True) + 1)


class Stream(IterableDataset):
    """`data()`'s samples as a stream that knows nothing of ranks: through a shuffle buffer of 5,
    seeded by the epoch (`set_epoch`)."""

    def __init__(self) -> None:
        self.samples = data()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rng, pending = random.Random(self.epoch), []
        for index in range(len(self.samples)):
            pending.append(index)
            if len(pending) == 5:
                yield self.samples[pending.pop(rng.randrange(len(pending)))]
        rng.shuffle(pending)
        yield from (self.samples[index] for index in pending)


def reference_weights(epochs: int = EPOCHS, shuffle: bool = False, stream: bool = False) -> list[list[float]]:
    """The job on one process in plain PyTorch, without any failure (`shuffle`: the `+split` job's
    `DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)`; `stream`: the `+stream` job's
    `DataLoader(Stream(), batch_size=GLOBAL_BATCH)`, its epoch set before each pass)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    source = Stream()
    for epoch in range(epochs):
        source.set_epoch(epoch)
        loader = DataLoader(source, batch_size=GLOBAL_BATCH) if stream else \
            DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=shuffle)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def act(out_dir: Path, how: str, rank: int, world_size: int) -> None:
    """What a rank does in the middle of the second epoch (see HOW above)."""
    if how == "wait-for-a-node" and world_size == 1:
        wait_to_be_stopped(out_dir)
    if rank != 1:
        return
    if how == "die-once" and not (out_dir / "died").exists():
        (out_dir / "died").touch()
        os._exit(3)
    if how == "wait-to-be-killed":
        wait_to_be_stopped(out_dir)


def wait_to_be_stopped(out_dir: Path) -> None:
    """Say where this process is (OUT_DIR/waiting holds its pid) and sleep until it is stopped."""
    (out_dir / "waiting").write_text(str(os.getpid()))
    time.sleep(600)


class Elastic(LightningLite):
    def run(self, out_dir: str, how: str, seconds_per_step: float) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).double()
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        how, split, stream = how.removesuffix("+split").removesuffix("+stream"), how.endswith("+split"), how.endswith("+stream")
        if stream:  # a stream of global batches, and a checkpoint after every step
            loader = self.setup_dataloaders(DataLoader(Stream(), batch_size=GLOBAL_BATCH), split_batches=True)
        elif split:  # the user's shuffled loader of global batches, and a checkpoint after every step
            loader = self.setup_dataloaders(DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True),
                                            split_batches=True)
        else:
            # Interleaved shards (no shuffle) of GLOBAL_BATCH / world_size: each step's ranks together
            # hold the same 8 samples as one process's batch of 8.
            loader = self.setup_dataloaders(DataLoader(data(), batch_size=GLOBAL_BATCH // self.world_size))
        checkpoint = os.environ.get("ELASTIC_JOB_CHECKPOINT") or Path(out_dir, "last.ckpt")
        mid_epoch = split or stream  # checkpoints after every step, the loader's position included
        state = {"epoch": 0, "step": 0, "model": model, "optimizer": optimizer, **({"loader": loader} if mid_epoch else {})}
        self.load(checkpoint, state, missing_ok=True)
        resumed_step = state["step"]
        for epoch in range(state["epoch"], EPOCHS):
            for x, y in loader:
                if state["step"] == len(data()) // GLOBAL_BATCH + 1:  # the second step of epoch 1
                    act(Path(out_dir), how, self.global_rank, self.world_size)
                optimizer.zero_grad()
                self.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                state["step"] += 1
                time.sleep(seconds_per_step)
                if mid_epoch:
                    state["epoch"] = epoch
                    self.save(state, checkpoint)
            print(f"epoch {epoch} world {self.world_size}", flush=True)
            if self.global_rank == 0:
                with open(Path(out_dir, "progress.txt"), "a") as progress:
                    progress.write(f"epoch {epoch} world {self.world_size}\n")
            state["epoch"] = epoch + 1
            self.save(state, checkpoint)
        record = {"weight": [whole(p).detach().flatten().tolist() for p in model.parameters()], "world": self.world_size,
                  "environment": self.strategy.environment.name, "restart": os.environ.get("LITE_RESTART_COUNT"), "resumed_step": resumed_step}
        Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor (fsdp holds a shard of it per rank, as a DTensor)."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def stagger_the_restart(out_dir: Path) -> None:
    """After the death, rank 0 builds its group first and rank 1 a second later, so that rank 0
    looks rank 1 up while only the dead attempt's rank 1 is in the store (unless it is scoped)."""
    if not (out_dir / "died").exists():
        return
    if os.environ.get("RANK") == "0":
        (out_dir / "rank0-restarted").touch()
    elif os.environ.get("RANK") == "1":
        while not (out_dir / "rank0-restarted").exists():
            time.sleep(0.05)
        time.sleep(1.0)


if __name__ == "__main__":
    out, how = sys.argv[1], sys.argv[2]
    if how == "die-once":
        stagger_the_restart(Path(out))
    Elastic().run(out, how, float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
