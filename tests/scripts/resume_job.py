"""Mid-epoch checkpoints resumed on another number of processes (`tests/integration/test_resume_anywhere.py`).

    python resume_job.py STRATEGY DEVICES OUT_DIR TASK [TASK ...]

Each TASK is `TAG:MODE:WORKERS:RESUME:STOP`: train a fresh model on a shuffled loader
(`DataLoader(data, batch_size=..., shuffle=True)`, the code a user writes) for `EPOCHS` epochs,
the loader set up with `split_batches=True` (MODE `split`, the batch is the global batch) or
per rank (MODE `rank`, the global batch split by hand into `GLOBAL_BATCH / world_size`).
`RESUME` names a checkpoint (in OUT_DIR) to load first, or `-`; `STOP` a global step after which
the task saves the checkpoint `TAG.ckpt` and stops, or `-` to run to the end. Each rank writes the
sample indices of its batch at every global step to `TAG-rankR.json`; rank 0 writes the final full
weights to `TAG-weights.pt`. `plain_run()` is one plain PyTorch process doing the same; `Job` runs in the
test's own process for one device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lite_core import LightningLite

torch.set_num_threads(1)

SAMPLES, GLOBAL_BATCH, EPOCHS, SEED = 60, 12, 2, 0


class Indexed(Dataset):
    """Sample `i` is `(i, x_i, y_i)`: the index tells the test which samples a step saw."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               backward=None) -> None:  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    (backward or torch.Tensor.backward)(loss)
    optimizer.step()


def plain_run(workers: int = 0) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """One plain PyTorch process: the samples of every step, and the final weights."""
    torch.manual_seed(SEED)
    model, optimizer = make_model()
    loader = DataLoader(Indexed(), batch_size=GLOBAL_BATCH, shuffle=True, num_workers=workers)
    steps = []
    for _ in range(EPOCHS):
        for index, x, y in loader:
            steps.append(index.tolist())
            train_step(model, optimizer, x, y)
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


class Job(LightningLite):
    def run(self, out_dir: str, tasks: list[str]) -> None:
        for task in tasks:
            self.task(Path(out_dir), *task.split(":"))

    def task(self, out: Path, tag: str, mode: str, workers: str, resume: str, stop: str) -> None:
        torch.manual_seed(SEED)
        model, optimizer = self.setup(*make_model())
        split = mode == "split"
        batch = GLOBAL_BATCH if split else GLOBAL_BATCH // self.world_size
        loader = self.setup_dataloaders(DataLoader(Indexed(), batch_size=batch, shuffle=True,
                                                   num_workers=int(workers)), split_batches=split)
        state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0}
        if resume != "-":
            self.load(out / resume, state)
        steps: dict[int, list[int]] = {}
        for epoch in range(state["epoch"], EPOCHS):
            for index, x, y in loader:
                state["step"] += 1
                steps[state["step"]] = index.tolist()
                train_step(model, optimizer, x, y, self.backward)
                if stop != "-" and state["step"] == int(stop):
                    state["epoch"] = epoch
                    self.save(state, out / f"{tag}.ckpt")
                    self.finish(out, tag, steps, model)
                    return
            state["epoch"] = epoch + 1
        self.finish(out, tag, steps, model)

    def finish(self, out: Path, tag: str, steps: dict[int, list[int]], model: nn.Module) -> None:
        (out / f"{tag}-rank{self.global_rank}.json").write_text(json.dumps(steps))
        weights = full_weights(model)
        if self.global_rank == 0:
            torch.save(weights, out / f"{tag}-weights.pt")
        self.barrier()


if __name__ == "__main__":
    Job(accelerator="cpu", strategy=sys.argv[1], devices=int(sys.argv[2])).run(sys.argv[3], sys.argv[4:])
