"""One training loop, with and without pipeline parallelism: only the strategy changes.

    python examples/pipeline_parallel.py                                   # one process
    python examples/pipeline_parallel.py --strategy ddp --devices 2
    python examples/pipeline_parallel.py --pipeline 2 --devices 2          # PP2, schedule 1F1B
    python examples/pipeline_parallel.py --pipeline 2 --devices 4 --schedule Interleaved1F1B   # PP2 x FSDP2

The model's loss function goes to `setup(..., loss_fn=...)`, and the loop calls
`loss = model(x, target=y)`: under a pipeline the schedule runs the forward and backward passes of
every micro-batch inside that call (so `self.backward(loss)` has nothing left to do); under any
other strategy it is `loss_fn(model(x), y)`. Every run prints the same final loss.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.strategies import ModelParallelStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    """Blocks in an `nn.ModuleList` and a head. A pipeline stage holds some of them: the list then
    iterates its own blocks, and the head hands its input on where the stage does not hold it, so
    the forward needs no guard."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """Applied to each stage's part: FSDP2 over the data-parallel ranks, when there are several."""
    data_parallel = device_mesh["data_parallel"]
    if data_parallel.size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=data_parallel)
        fully_shard(model, mesh=data_parallel)
    return model


class Train(LightningLite):
    def run(self, args: argparse.Namespace) -> float:
        self.seed_everything(7)
        model = Model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = self.setup(model, optimizer, loss_fn=nn.functional.mse_loss)
        x = torch.randn(256, 16)
        data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
        shard = self.strategy.distributed_sampler_kwargs() or {"num_replicas": 1}
        batch_size = args.global_batch_size // shard["num_replicas"]  # the same global batch on any layout
        loader = self.setup_dataloaders(DataLoader(data, batch_size=batch_size))
        for _ in range(args.epochs):
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = model(inputs, target=targets)
                self.backward(loss)
                self.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
        with torch.no_grad():  # forward only, under a pipeline too
            inputs, targets = self.to_device(x[:8]), self.to_device(data.tensors[1][:8])
            loss = model(inputs, target=targets)
        return self.all_reduce(loss).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline_parallel_size")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    args = parser.parse_args()
    strategy = args.strategy
    if args.pipeline > 1:
        split_points = ["blocks.1", "blocks.2", "blocks.3"] if "interleaved" in args.schedule.lower() else ["blocks.2"]
        strategy = ModelParallelStrategy(parallelize, pipeline_parallel_size=args.pipeline,
                                         pipeline_schedule=args.schedule, microbatches=4, split_points=split_points)
    lite = Train(accelerator="cpu", strategy=strategy, devices=args.devices)
    final = lite.run(args)
    if lite.is_global_zero:
        print(f"final loss {final:.6f}")


if __name__ == "__main__":
    main()
