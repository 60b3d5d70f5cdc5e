"""Sampler injection and DDP training under a 2-process strategy.

    python train.py STRATEGY OUT_DIR

Writes, per rank, `OUT_DIR/sampling_rank{r}.json` (the sample indexes each set-up dataloader
gave this rank, per epoch) and `OUT_DIR/grads_rank{r}.json` (gradient checks during
accumulation); rank 0 also writes `OUT_DIR/training.pt` with the data, the initial weights and
the final weights of plain DDP training and of training with gradient accumulation, so that the
test can replay both with a plain one-process PyTorch loop.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from lite_core import LightningLite

torch.set_num_threads(1)

SAMPLES = 32
FEATURES = 4
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # per rank; 2 micro-batches per optimizer step
LR = 0.1


class RangeDataset(Dataset):
    """Sample `i` is the integer `i`."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class FixedPermutation(Sampler[int]):
    """A user sampler: always the same permutation `(7 * i + 3) % n`."""

    def __init__(self, size: int) -> None:
        self.order = [(7 * i + 3) % size for i in range(size)]

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randn(SAMPLES, 1, generator=generator)
    return x, y


class Train(LightningLite):
    def run(self, out_dir: str) -> str:
        self.check_sampling(out_dir)
        self.train_plain()
        self.train_accumulating(out_dir)
        return json.dumps({"rank": self.global_rank, "pid": os.getpid()})

    # -- sampler injection --------------------------------------------------------------------
    def epochs_of(self, loader, epochs: int = 1) -> dict:
        seen = []
        for _ in range(epochs):
            batches = [batch.tolist() for batch in loader]
            seen.append(batches)
        return {"batches": seen, "len": len(loader), "drop_last": loader.dataloader.drop_last,
                "sampler": type(loader.dataloader.sampler).__name__}

    def check_sampling(self, out_dir: str) -> None:
        record = {}
        record["sequential"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, shuffle=False)))
        record["shuffled"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(20), batch_size=5, shuffle=True)), epochs=2)
        record["drop_last"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(11), batch_size=2, drop_last=True)))
        record["keep_last"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(11), batch_size=2, drop_last=False)))
        record["custom_sampler"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, sampler=FixedPermutation(10))))
        mine = DistributedSampler(RangeDataset(10), num_replicas=2, rank=self.global_rank, shuffle=False)
        loader = self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, sampler=mine))
        record["own_distributed_sampler"] = self.epochs_of(loader)
        record["own_distributed_sampler"]["same_object"] = loader.dataloader.sampler is mine
        Path(out_dir, f"sampling_rank{self.global_rank}.json").write_text(json.dumps(record))

    # -- training --------------------------------------------------------------------------------
    def fresh(self):
        torch.manual_seed(0)
        model = make_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = self.setup(model, optimizer)
        return model, optimizer, initial

    def train_plain(self) -> None:
        model, optimizer, initial = self.fresh()
        x, y = make_data()
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // 2, shuffle=False))
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            self.backward(loss)
            optimizer.step()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = self.all_gather(weights)
        self.results = {"x": x, "y": y, "initial": initial, "plain_final": weights, "plain_steps": len(loader),
                        "plain_ranks_agree": all(torch.equal(g[0], g[1]) for g in gathered.values())}

    def train_accumulating(self, out_dir: str) -> None:
        model, optimizer, initial = self.fresh()
        x, y = make_data()
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=MICRO_BATCH, shuffle=False))
        checks = []
        batches = iter(loader)
        steps = len(loader) // 2
        for _ in range(steps):
            optimizer.zero_grad()
            xb, yb = next(batches)
            with self.no_backward_sync(model):
                self.backward(nn.functional.mse_loss(model(xb), yb))
            unsynced = self.all_gather(model.module[0].weight.grad.clone())
            xb, yb = next(batches)
            self.backward(nn.functional.mse_loss(model(xb), yb))
            synced = self.all_gather(model.module[0].weight.grad.clone())
            checks.append({
                "differ_after_no_sync": not torch.allclose(unsynced[0], unsynced[1]),
                "equal_after_sync": torch.equal(synced[0], synced[1]),
            })
            optimizer.step()
        Path(out_dir, f"grads_rank{self.global_rank}.json").write_text(json.dumps(checks))
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = self.all_gather(weights)
        self.results.update(
            accumulated_final=weights,
            accumulated_steps=steps,
            initial_accumulating=initial,
            accumulated_ranks_agree=all(torch.equal(g[0], g[1]) for g in gathered.values()),
        )
        if self.global_rank == 0:
            torch.save(self.results, Path(out_dir, "training.pt"))


def main() -> None:
    strategy, out_dir = sys.argv[1], sys.argv[2]
    result = Train(accelerator="cpu", strategy=strategy, devices=2).run(out_dir)
    print(f"RESULT pid={os.getpid()} {result}")


if __name__ == "__main__":
    main()
