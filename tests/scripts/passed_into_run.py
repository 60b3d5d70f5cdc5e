"""A model and data made by the caller and passed into `run()`, under ddp_spawn and ddp_fork, and
the same training in plain PyTorch: `torch.multiprocessing` + DDP where each rank holds its own
copy of the model.

    python passed_into_run.py OUT_DIR

Writes `OUT_DIR/{reference,ddp_spawn,ddp_fork}.pt` (rank 0's final weights) and
`OUT_DIR/caller.pt` (the caller's model after the Lite runs: untouched).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lite_core import LightningLite

STEPS = 6


def batch(rank: int, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice((2 * step + rank) * 4, (2 * step + rank + 1) * 4)
    return x[rows], y[rows]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, x: torch.Tensor, y: torch.Tensor,
          backward) -> None:
    for step in range(STEPS):
        inputs, targets = batch(rank, step, x, y)
        optimizer.zero_grad()
        backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()


class Train(LightningLite):
    def run(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        train(model, optimizer, self.global_rank, x, y, self.backward)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_rank(rank: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor, store: str, out: str) -> None:
    torch.set_num_threads(1)
    # a file store: a port drawn here could be taken by another process before rank 0 binds it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = DistributedDataParallel(copy.deepcopy(model))  # each rank its own copy
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, x, y, lambda loss: loss.backward())
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    dist.barrier()  # rank 0 hosts the store: no rank may leave while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(2 * STEPS * 8, 8), torch.randn(2 * STEPS * 8, 1)
    initial = copy.deepcopy(model.state_dict())
    store = str(out_dir / "reference-store")
    mp.spawn(reference_rank, args=(model, x, y, store, str(out_dir / "reference.pt")), nprocs=2)
    for strategy in ("ddp_spawn", "ddp_fork"):
        weights = Train(accelerator="cpu", strategy=strategy, devices=2).run(model, x, y)
        torch.save(weights, out_dir / f"{strategy}.pt")
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items()), "the caller's model changed"
    print("OK")
