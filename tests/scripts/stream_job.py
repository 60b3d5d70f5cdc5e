"""Streams trained under data parallelism and resumed on another number of processes
(`tests/integration/test_streams.py`).

    python stream_job.py STRATEGY DEVICES OUT_DIR TASK [TASK ...]

Each TASK is `TAG:DATA:MODE:WORKERS:RESUME:STOP`: train a fresh model for `EPOCHS` epochs on a
stream (`DataLoader(stream, batch_size=...)`, the code a user writes, the stream knowing nothing of
ranks or workers). DATA is `rows` (indexed samples through a shuffle buffer seeded by the epoch)
or `packed` (token documents packed into blocks of `BLOCK` tokens, the block under way carried from
one document to the next). MODE `split` sets the loader up with `split_batches=True` (the batch is
the global batch), `rank` gives it the per-rank batch `GLOBAL_BATCH / world_size`. `RESUME` names a
checkpoint in OUT_DIR to load first, or `-`; `STOP` a global step after which the task saves
`TAG.ckpt` and stops, or `-`. Each rank writes the sample ids of its batch at every global step to
`TAG-rankR.json`; rank 0 writes the final weights to `TAG-weights.pt`. A TASK `TAG:evaluate:N`
instead runs one evaluation pass (`model.eval()`) over a `Rows` stream cut to N samples, per-rank
batches of 4, and rank 0 writes the ids that `gather_for_metrics` collected to `TAG-gathered.json`.
`plain_run(data)` is one plain PyTorch process reading the same stream; `Job` also runs in the
test's own process.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lite_core import LightningLite

torch.set_num_threads(1)

SAMPLES, GLOBAL_BATCH, EPOCHS, SEED, BLOCK = 60, 12, 2, 0, 4


class Rows(IterableDataset):
    """`(id, x, y)` for ids 0..samples-1, through a shuffle buffer of 7 seeded by the epoch."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.samples = samples
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, BLOCK, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        rng, pending = random.Random(self.epoch), []
        for index in range(self.samples):
            pending.append(index)
            if len(pending) == 7:
                yield self._sample(pending.pop(rng.randrange(len(pending))))
        rng.shuffle(pending)
        for index in pending:
            yield self._sample(index)

    def _sample(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Packed(IterableDataset):
    """SAMPLES blocks of BLOCK tokens from documents of 1 to 7 tokens; a block's id is its first token."""

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        token, block, blocks = 0, [], 0
        for document in range(10 * SAMPLES):
            for _ in range(1 + document % 7):
                block.append(token)
                token += 1
                if len(block) == BLOCK:
                    tokens = torch.tensor(block, dtype=torch.float32)
                    yield block[0], torch.sin(tokens), torch.cos(tokens.sum()).reshape(1)
                    block, blocks = [], blocks + 1
                    if blocks == SAMPLES:
                        return


def stream(data: str) -> IterableDataset:
    return Rows() if data == "rows" else Packed()


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(BLOCK, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               backward=None) -> None:  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    (backward or torch.Tensor.backward)(loss)
    optimizer.step()


def plain_run(data: str) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """One plain PyTorch process reading the stream: the ids of every step, and the final weights."""
    torch.manual_seed(SEED)
    model, optimizer = make_model()
    dataset = stream(data)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH)
    steps = []
    for epoch in range(EPOCHS):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        for ids, x, y in loader:
            steps.append(ids.tolist())
            train_step(model, optimizer, x, y)
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


class Job(LightningLite):
    def run(self, out_dir: str, tasks: list[str]) -> None:
        for task in tasks:
            self.task(Path(out_dir), *task.split(":"))

    def task(self, out: Path, tag: str, data: str, *args: str) -> None:
        if data == "evaluate":
            return self.evaluate(out, tag, int(args[0]))
        return self.train(out, tag, data, *args)

    def evaluate(self, out: Path, tag: str, samples: int) -> None:
        model = self.setup(make_model()[0])
        loader = self.setup_dataloaders(DataLoader(Rows(samples), batch_size=4))
        model.eval()
        gathered = []
        with torch.no_grad():
            for ids, x, _ in loader:
                model(x)  # an empty batch too
                gathered += self.gather_for_metrics(ids).tolist()  # a collective per batch: as many on every rank
        if self.global_rank == 0:
            (out / f"{tag}-gathered.json").write_text(json.dumps(gathered))
        self.barrier()

    def train(self, out: Path, tag: str, data: str, mode: str, workers: str, resume: str, stop: str) -> None:
        torch.manual_seed(SEED)
        model, optimizer = self.setup(*make_model())
        split = mode == "split"
        batch = GLOBAL_BATCH if split else GLOBAL_BATCH // self.world_size
        loader = self.setup_dataloaders(DataLoader(stream(data), batch_size=batch, num_workers=int(workers)),
                                        split_batches=split)
        state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0}
        if resume != "-":
            self.load(out / resume, state)
        steps: dict[int, list[int]] = {}
        for epoch in range(state["epoch"], EPOCHS):
            for ids, x, y in loader:
                state["step"] += 1
                steps[state["step"]] = ids.tolist()
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
        weights = self.full_state_dict(model)  # gathered from the shards under fsdp
        if self.global_rank == 0:
            torch.save(weights, out / f"{tag}-weights.pt")
        self.barrier()


def tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """The first Linear split by columns and the last by rows over the tensor-parallel dimension,
    the model sharded over the data-parallel one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["data_parallel"])


def strategy_of(name: str) -> Any:
    """`model_parallel`: data parallel 2 x tensor parallel 2 (`tensor_parallel`); else the name."""
    if name != "model_parallel":
        return name
    from lite_core.strategies import ModelParallelStrategy

    return ModelParallelStrategy(tensor_parallel, data_parallel_size=2, tensor_parallel_size=2)


if __name__ == "__main__":
    Job(accelerator="cpu", strategy=strategy_of(sys.argv[1]), devices=int(sys.argv[2])).run(sys.argv[3], sys.argv[4:])
