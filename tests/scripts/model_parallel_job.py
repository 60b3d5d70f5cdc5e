"""`model_parallel` on 4 processes, for comparison with one plain PyTorch process.

    python model_parallel_job.py OUT_DIR

One job runs every check, each with its own `LightningLite` in the same 4 processes (the first
launches them; the others find them started and reuse the process group), so that 4 processes
start once. Rank 0 writes `OUT_DIR/results.pt`:

- `train_{dp}x{tp}`: training with clipping under dp2 x tp2, dp1 x tp4 and dp4 x tp1 (initial and
  final full weights, the norms, every rank's first batch, a sum over the tensor-parallel group);
- `empty_init`: a model built inside `init_module(empty_init=True)` on dp2 x tp2;
- `precision_{name}`: training under `bf16-mixed` and `bf16-true` on dp2 x tp2;
- `hsdp`: the same training under `FSDPStrategy(replicate_size=2)`, with its parameters' placements;
- `resume`: two models and optimizers saved on dp2 x tp2 (sharded and one file) and the
  uninterrupted steps after the save (`S3`, `S4`), and what loading gave under other layouts and
  strategies (`from_*`), each after one step;
- `errors`: the messages of the bad inputs that need processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.errors import MisuseError
from lite_core.strategies import FSDPStrategy, ModelParallelStrategy

torch.set_num_threads(1)

SAMPLES = 32
GLOBAL_BATCH = 8
LR = 0.05
SPLIT_SEED = 7
MAX_NORM = 0.5


class MLP(nn.Module):
    """Two tensor-parallel projections and a head that only data parallelism shards."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))  # computed in __init__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.tanh(self.up(x))) * self.scale)


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    parallelize_module(model, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 8, generator=generator)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in model.state_dict().items()}


def model_parallel(dp: int, tp: int, precision: str = "32-true") -> LightningLite:
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=tp)
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=4, precision=precision)
    lite.launch()  # the first call starts the processes; later ones find them started
    return lite


def started(strategy) -> LightningLite:
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=4)
    lite.launch()
    return lite


def train(lite: LightningLite, clip: bool) -> dict:
    torch.manual_seed(0)
    model = MLP()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    replicas = lite.strategy.distributed_sampler_kwargs()["num_replicas"]
    loader = lite.setup_dataloaders(DataLoader(TensorDataset(*make_data()), batch_size=GLOBAL_BATCH // replicas))
    norms, batches = [], None
    for xb, yb in loader:
        if batches is None:
            batches = lite.all_gather(xb)
        optimizer.zero_grad()
        lite.backward(nn.functional.mse_loss(model(xb), yb))
        if clip:
            norms.append(lite.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
    return {"initial": initial, "final": full_weights(model), "norms": norms, "batches": batches,
            "params": {n: f"{type(p).__name__}{tuple(getattr(p, 'placements', ()))}" for n, p in model.named_parameters()}}


def split_first_batch(lite: LightningLite) -> torch.Tensor:
    """Every rank's part of the first batch of a shuffled loader set up with `split_batches=True`,
    gathered by global rank (its `batch_size` is the global batch)."""
    loader = DataLoader(TensorDataset(*make_data()), batch_size=GLOBAL_BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(SPLIT_SEED))
    xb, _ = next(iter(lite.setup_dataloaders(loader, split_batches=True)))
    return lite.all_gather(xb)


def tensor_parallel_collectives(lite: LightningLite) -> dict:
    group = lite.strategy.device_mesh["tensor_parallel"].get_group()
    rank = torch.tensor(float(lite.global_rank))
    return {"tp_sum": lite.all_reduce(rank, group=group, reduce_op="sum"),
            "world_sum": lite.all_reduce(rank, reduce_op="sum")}


def empty_init(lite: LightningLite) -> dict:
    torch.manual_seed(7)
    with lite.init_module(empty_init=True):
        model = MLP()
    on_meta = all(p.is_meta for p in model.parameters())
    model = lite.setup_module(model)
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    built = full_weights(model)
    # setup_module + setup_optimizers: an optimizer made from the returned model's parameters.
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    optimizer.zero_grad()
    lite.backward(nn.functional.mse_loss(model(lite.to_device(X)), lite.to_device(Y)))
    optimizer.step()
    refused = error_of(lambda: lite.setup_optimizers(torch.optim.SGD(MLP().parameters(), lr=LR)))
    return {"on_meta": on_meta, "local_numel": local, "final": built, "scale": model.scale.detach().clone(),
            "stepped": full_weights(model), "foreign_optimizer": refused}


# -- checkpoints ---------------------------------------------------------------------------------
X, Y = make_data()[0][:GLOBAL_BATCH], make_data()[1][:GLOBAL_BATCH]


def two_models(lite: LightningLite, seed: int) -> dict:
    state = {}
    for index, suffix in enumerate(("", "2")):
        torch.manual_seed(seed + index)
        model = MLP()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        state[f"model{suffix}"], state[f"optimizer{suffix}"] = lite.setup(model, optimizer)
    return state


def step(lite: LightningLite, state: dict) -> dict:
    """One Adam step of both models on the same full batch on every rank; their full weights."""
    weights = {}
    for suffix in ("", "2"):
        model, optimizer = state[f"model{suffix}"], state[f"optimizer{suffix}"]
        optimizer.zero_grad()
        lite.backward(nn.functional.mse_loss(model(lite.to_device(X)), lite.to_device(Y)))
        optimizer.step()
        weights[f"model{suffix}"] = full_weights(model)
    return weights


def resume(lite: LightningLite, path: Path, save_to: Path | None = None) -> dict:
    state = {**two_models(lite, seed=50), "step": 0}
    lite.load(path, state)
    loaded_step = state["step"]
    weights = step(lite, state)
    if save_to is not None:
        lite.save({**state, "step": loaded_step + 1}, save_to)
    return {**weights, "step": loaded_step}


def save_on_2x2(lite: LightningLite, out: Path) -> dict:
    state = two_models(lite, seed=10)
    step(lite, state)
    step(lite, state)
    lite.save({**state, "step": 2}, out / "mp_sharded")
    lite.strategy.state_dict_type = "full"  # as ModelParallelStrategy(save_distributed_checkpoint=False)
    lite.save({**state, "step": 2}, out / "mp_full.pt")
    lite.strategy.state_dict_type = "sharded"
    return {"S3": step(lite, state), "S4": step(lite, state)}


# -- bad input -----------------------------------------------------------------------------------
class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def error_of(action) -> str:
    try:
        action()
    except MisuseError as err:
        return str(err)
    return "no error"


def bad_inputs() -> dict:
    returns_none = ModelParallelStrategy(lambda model, mesh: None, data_parallel_size=1, tensor_parallel_size=4)
    lite = started(returns_none)
    not_a_module = error_of(lambda: lite.setup_module(MLP()))
    uneven_plan = ModelParallelStrategy(
        lambda model, mesh: parallelize_module(model, mesh["tensor_parallel"], {"proj": ColwiseParallel()}),
        data_parallel_size=1, tensor_parallel_size=4)
    lite = started(uneven_plan)
    uneven = error_of(lambda: lite.setup_module(Uneven()))
    return {"not_a_module": not_a_module, "uneven": uneven}


def main(out: Path) -> None:
    results: dict = {}
    lite = model_parallel(2, 2)
    results["train_2x2"] = {**train(lite, clip=True), **tensor_parallel_collectives(lite), "split": split_first_batch(lite)}
    results["empty_init"] = empty_init(lite)
    results["resume"] = save_on_2x2(lite, out)
    for dp, tp in ((1, 4), (4, 1)):
        layout = model_parallel(dp, tp)
        results[f"train_{dp}x{tp}"] = {**train(layout, clip=True), "split": split_first_batch(layout)}
    for precision in ("bf16-mixed", "bf16-true"):
        results[f"precision_{precision}"] = train(model_parallel(2, 2, precision), clip=False)
    results["hsdp"] = train(started(FSDPStrategy(replicate_size=2)), clip=True)
    resumed = results["resume"]
    resumed["from_sharded_on_1x4"] = resume(model_parallel(1, 4), out / "mp_sharded")
    resumed["from_full_on_4x1"] = resume(model_parallel(4, 1), out / "mp_full.pt")
    resumed["from_sharded_on_fsdp"] = resume(started("fsdp"), out / "mp_sharded", save_to=out / "fsdp_sharded")
    resumed["from_sharded_on_ddp"] = resume(started("ddp"), out / "mp_sharded", save_to=out / "ddp.pt")
    resumed["from_fsdp_on_1x4"] = resume(model_parallel(1, 4), out / "fsdp_sharded")
    resumed["from_ddp_on_4x1"] = resume(model_parallel(4, 1), out / "ddp.pt")
    results["errors"] = bad_inputs()
    if lite.global_rank == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
