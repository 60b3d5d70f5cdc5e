"""Activation checkpointing (`activation_checkpointing={Block}`) under ddp, fsdp and model_parallel
(FSDP2 over 2 data-parallel ranks, and a 2-stage pipeline), each beside the same run without it.

    python recompute_job.py OUT_DIR

One job on 2 processes runs every layout, each with its own `LightningLite` in the same processes
(the first launches them; the others reuse them). Each takes one training step of the same user
loop and records the full gradients, how often the blocks' forward ran, the set-up model's
parameter names and state-dict keys; the fsdp run with recompute saves a sharded checkpoint and
the ddp run with recompute a one-file one, and a ddp run without recompute loads the sharded one.
Rank 0 writes `OUT_DIR/results.pt`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from lite_core import LightningLite
from lite_core.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

torch.set_num_threads(1)

WIDTH = 8
BATCH = 8  # per process


class Block(nn.Module):
    #: How often any block's forward ran (recompute runs it again in the backward pass).
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.1)  # recompute must replay the same random mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.down(self.dropout(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def shard_blocks(model: nn.Module, device_mesh: Any) -> nn.Module:
    """The user's parallelize_fn: FSDP2 over the data-parallel ranks."""
    dp = device_mesh["data_parallel"]
    if dp.size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


LAYOUTS: dict[str, Callable[..., Any]] = {
    "ddp": lambda **ac: DDPStrategy(**ac),
    "fsdp": lambda **ac: FSDPStrategy(auto_wrap_policy={Block}, **ac),
    "model_parallel": lambda **ac: ModelParallelStrategy(shard_blocks, data_parallel_size=2, tensor_parallel_size=1,
                                                         **ac),
    "pipeline": lambda **ac: ModelParallelStrategy(None, pipeline_parallel_size=2, microbatches=2,
                                                   pipeline_schedule="GPipe", split_points=["blocks.2"], **ac),
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().cpu().clone()


def gathered(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every process's entries (a pipeline's stages hold different parameters)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def one_step(layout: str, recompute: bool, save_to: Path | None = None) -> dict:
    options = {"activation_checkpointing": {Block}} if recompute else {}
    lite = LightningLite(accelerator="cpu", strategy=LAYOUTS[layout](**options), devices=2)
    lite.launch()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    generator = torch.Generator().manual_seed(1 + lite.global_rank if layout != "pipeline" else 1)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
    torch.manual_seed(7)  # the same dropout masks with and without recompute
    Block.calls = 0
    loss = model(x, target=y)
    lite.backward(loss)
    calls = Block.calls
    grads = gathered({name: full(p.grad) for name, p in model.named_parameters()})
    optimizer.step()
    if save_to is not None:
        lite.save({"model": model}, save_to)
    return {"loss": loss.item(), "grads": grads, "calls": calls, "names": sorted(grads),
            "keys": sorted(gathered({k: torch.zeros(()) for k in model.state_dict()})),
            "weights": gathered({k: full(v) for k, v in model.state_dict().items()})}


def load_without_recompute(path: Path) -> dict[str, torch.Tensor]:
    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    lite.launch()
    model = lite.setup(Net())
    lite.load(path, {"model": model})
    return {k: full(v) for k, v in model.state_dict().items()}


def main(out: Path) -> None:
    results: dict = {}
    for layout in LAYOUTS:
        results[layout] = {
            "without": one_step(layout, recompute=False),
            "with": one_step(layout, recompute=True,
                             save_to={"fsdp": out / "fsdp_sharded", "ddp": out / "ddp.pt"}.get(layout)),
        }
    results["loaded_from_fsdp_sharded"] = load_without_recompute(out / "fsdp_sharded")
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
