"""FP8 (torchao's float8 training, emulated on the CPU) under ddp, fsdp and model_parallel (tensor
parallel, and a 2-stage pipeline) on 2 processes, each beside the same parallel loop written by
hand with torchao's conversion applied by hand.

    python fp8_job.py OUT_DIR

One job runs every case, each with its own `LightningLite` in the same processes (the first
launches them; the others reuse them). Each case trains `STEPS` SGD steps of the same user loop
and records the losses and the full weights:

- `lite/<layout>/<recipe>` and `by_hand/<layout>/<recipe>`, with bf16 autocast (the default);
  (`tp`: `parallelize_module` with torch's own `ColwiseParallel`/`RowwiseParallel` on the blocks);
- `lite/ddp/<recipe>/fp32` and `lite/pipeline/rowwise/fp32` with `autocast_dtype=None`, and on
  rank 0 `one_process/<recipe>`: one plain process converted by hand on the global batch (both
  ranks' halves; the pipeline reads that whole batch on both ranks, in 2 micro-batches);
- checkpoint moves: an fsdp FP8 run's sharded checkpoint loaded by a ddp `bf16-mixed` run
  (`moved/fp8_to_bf16`), and a ddp `bf16-mixed` checkpoint loaded by an fsdp FP8 run
  (`moved/bf16_to_fp8`, beside the saved weights in `moved/bf16_saved`).

Rank 0 writes `OUT_DIR/results.pt`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from lite_core import Float8Precision, LightningLite
from lite_core.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

torch.set_num_threads(1)

WIDTH = 32  # FP8 matmuls need dimensions that are multiples of 16
BATCH = 16  # per process
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 8)  # the output head: torchao's recipes leave it in high precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x  # a pipeline stage may not hold the head


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 8, generator=generator)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().cpu().clone()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def every_ranks_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of every rank's part (a pipeline's stages hold different parameters)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, weights(model))
    return {k: v for part in parts for k, v in part.items()}


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any, autocast: torch.dtype | None,
          backward: Any = None) -> list[float]:
    """The user's loop (with Lite, `autocast` is None: the precision applies it)."""
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """The user's parallelize_fn: each block's projections split over the tensor-parallel ranks."""
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


STRATEGIES = {
    "ddp": lambda: DDPStrategy(),
    "fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}),
    "tp": lambda: ModelParallelStrategy(tensor_parallel, data_parallel_size=1, tensor_parallel_size=2),
    "pipeline": lambda: ModelParallelStrategy(None, pipeline_parallel_size=2, microbatches=2, pipeline_schedule="GPipe",
                                              split_points=["blocks.1"], loss_fn=loss_fn),
}


def batches(layout: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: its own half under data parallelism, rank 0's under tensor parallelism
    (the ranks of one model replica read the same batch), the whole global batch in a pipeline."""
    if layout == "tp":
        return [batch(s, 0) for s in range(STEPS)]
    if layout == "pipeline":
        return global_batches()
    return [batch(s, rank) for s in range(STEPS)]


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    halves = [[batch(s, rank) for rank in (0, 1)] for s in range(STEPS)]
    return [(torch.cat([x for x, _ in h]), torch.cat([y for _, y in h])) for h in halves]


def with_lite(layout: str, precision: Any, save_to: Path | None = None, load_from: Path | None = None) -> dict:
    lite = LightningLite(accelerator="cpu", strategy=STRATEGIES[layout](), devices=2, precision=precision)
    lite.launch()
    torch.manual_seed(0)
    model = Net()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if load_from is not None:
        lite.load(load_from, {"model": model})
        return {"weights": every_ranks_weights(model), "float8_all_gather": float8_all_gather(model)}
    if layout == "pipeline":  # the schedule runs the loss: the set-up model takes the target
        losses = []
        for x, y in global_batches():
            loss = model(x, target=y)
            lite.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    else:
        losses = train(model, optimizer, batches(layout, lite.global_rank), None, lite.backward)
    if save_to is not None:
        lite.save({"model": model}, save_to)
    return {"losses": losses, "weights": every_ranks_weights(model), "float8_all_gather": float8_all_gather(model)}


def float8_all_gather(model: nn.Module) -> bool:
    """Whether FSDP2 all-gathers the model's weights in float8 (torchao's weight wrapper is there)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return any(isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)
               for p in model.parameters())


def converted(recipe: str, float8_all_gather: bool = False) -> Net:
    """The model with torchao's conversion applied by hand: every Linear but the head."""
    torch.manual_seed(0)
    model = Net()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True,
                                 enable_fsdp_float8_all_gather=float8_all_gather)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name != "head")


def by_hand(layout: str, recipe: str) -> dict:
    # torchao's float8 all-gather under fully_shard, with the recipe that has it (as Lite's default)
    model = converted(recipe, float8_all_gather=layout == "fsdp" and recipe == "tensorwise")
    if layout == "ddp":
        model = DistributedDataParallel(model)
    elif layout == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, optimizer, batches(layout, dist.get_rank()), torch.bfloat16)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {"losses": losses, "weights": weights(inner)}


def one_process(recipe: str) -> dict:
    """One plain process on the global batch (both ranks' halves), in float32 around the FP8 matmuls."""
    model = converted(recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, optimizer, global_batches(), None)
    return {"losses": losses, "weights": weights(model)}


def main(out: Path) -> None:
    results: dict = {}
    for recipe in ("tensorwise", "rowwise"):
        for layout in ("ddp", "fsdp", "tp"):
            results[f"lite/{layout}/{recipe}"] = with_lite(layout, Float8Precision(recipe, emulate=True))
            results[f"by_hand/{layout}/{recipe}"] = by_hand(layout, recipe)
        results[f"lite/ddp/{recipe}/fp32"] = with_lite("ddp", Float8Precision(recipe, emulate=True,
                                                                               autocast_dtype=None))
        if dist.get_rank() == 0:
            results[f"one_process/{recipe}"] = one_process(recipe)
    results["lite/pipeline/rowwise/fp32"] = with_lite("pipeline", Float8Precision("rowwise", emulate=True,
                                                                                  autocast_dtype=None))
    results["moved/fp8_saved"] = with_lite("fsdp", Float8Precision("rowwise", emulate=True),
                                           save_to=out / "fp8_sharded")
    results["moved/fp8_to_bf16"] = with_lite("ddp", "bf16-mixed", load_from=out / "fp8_sharded")
    results["moved/bf16_saved"] = with_lite("ddp", "bf16-mixed", save_to=out / "bf16.pt")
    results["moved/bf16_to_fp8"] = with_lite("fsdp", Float8Precision("rowwise", emulate=True),
                                             load_from=out / "bf16.pt")
    # The same with torchao's float8 all-gather (tensorwise under fsdp): its weight wrapper stays out
    # of the checkpoint, which loads without FP8, and a plain checkpoint loads into it.
    results["moved/fp8_all_gather_saved"] = with_lite("fsdp", Float8Precision("tensorwise", emulate=True),
                                                      save_to=out / "fp8_all_gather_sharded")
    results["moved/fp8_all_gather_to_bf16"] = with_lite("ddp", "bf16-mixed", load_from=out / "fp8_all_gather_sharded")
    results["moved/fp8_all_gather_round_trip"] = with_lite("fsdp", Float8Precision("tensorwise", emulate=True),
                                                           load_from=out / "fp8_all_gather_sharded")
    results["moved/bf16_to_fp8_all_gather"] = with_lite("fsdp", Float8Precision("tensorwise", emulate=True),
                                                        load_from=out / "bf16.pt")
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
