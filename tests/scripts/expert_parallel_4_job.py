"""Expert parallelism (`lite_core.parallel.ExpertParallel`) on 4 processes, for comparison with one
plain PyTorch process: a hand-written tiny Mixture-of-Experts (8 stacked experts, top-2 softmax
routing, no capacity factor) trained with gradient accumulation and clipping under three layouts
of `ModelParallelStrategy`, one after the other in the same 4 processes (the first `launch` starts
them, the others reuse the process group):

- `ep2_dp2`: `MeshLayout(shard=4, expert=2)`: the experts sharded over the 2 processes of
  `"expert_parallel"` and FSDP2 over the 2 of `"expert_data_parallel"`, the other weights FSDP2
  over the 4 of `"data_parallel"`;
- `ep4`: `MeshLayout(shard=4, expert=4)`: each process holds 2 of the 8 experts;
- `ep2_tp2`: `MeshLayout(shard=2, tensor=2, expert=2)`: the experts over `"expert_parallel"`, the
  embedding and the router tensor parallel over `"tensor_parallel"` (the experts whole on both of
  its processes), FSDP2 over `"data_parallel"`.

Under context parallelism, `ep2_cp2` and `ep4_cp2` (`CONTEXT_LAYOUTS`): sequences cut in two
along their positions by the set-up loader, the experts over each context group's 2 processes or
over all 4.

And `ep2_dp2_balanced`: `ep2_dp2` with the router's load-balancing loss over the global batch
(`load_balancing_loss`, whose processes are the 4 data-parallel ones, not the experts' 2) added to
each micro-batch's loss.

Then `pp2_ep2`: `MeshLayout(pipeline=2, shard=2, expert=2)`, a model of two MoE blocks cut into 2
pipeline stages (the embedding and the first block, the second block and the head), each stage's
experts sharded over its 2 processes of `"expert_parallel"`, trained with `loss = model(x, target=y)`.

It saves a checkpoint (`OUT/ckpt_pp2_ep2`). Then `pp2x2_ep2`: 4 MoE blocks, a stage each, 2 stages on
every process under interleaved 1F1B, each stage's experts over its 2 processes.

Then the checkpoint `ep4` saved (`OUT/ckpt_ep4`), loaded into a differently initialised model under
`ep2_dp2` and trained one more step (`moved`); last, what is refused (`refusals`: experts that do
not divide over 4 processes, `expert=3`, experts that do not span the data-parallel processes).

    python expert_parallel_4_job.py OUT_DIR

Rank 0 writes `OUT_DIR/results.pt`: per layout the initial weights, the first step's whole
gradients (before clipping), the norms, the losses, rank 0's `expert_load` per step with the
data-parallel ranks whose tokens it counts, and the final whole weights (under the pipeline every
stage's, and each block's `expert_load` from a process of its stage); the probe's logits; and the
messages of what is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.errors import LiteError
from lite_core.parallel import ExpertParallel, MeshLayout, expert_load, load_balancing_loss
from lite_core.strategies import ModelParallelStrategy

torch.set_num_threads(1)

WORLD = 4
GLOBAL_BATCH = 32
ACCUMULATE = 2  # micro-batches per optimizer step on every data-parallel process
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
MAX_NORM = 0.3
BALANCE = 0.5  # the weight of the router's load-balancing loss in `ep2_dp2_balanced`
IN, HIDDEN, FFN, EXPERTS, TOP_K = 4, 8, 16, 8, 2
LAYOUTS = {"ep2_dp2": MeshLayout(shard=4, tensor=1, expert=2), "ep4": MeshLayout(shard=4, tensor=1, expert=4),
           "ep2_tp2": MeshLayout(shard=2, tensor=2, expert=2)}
#: Context parallelism (each sequence cut in 2, head-tail) with the experts over the 2 processes of
#: each context group (`ep2_cp2`) and over all 4 (`ep4_cp2`: both context groups of a data pair).
CONTEXT_LAYOUTS = {"ep2_cp2": MeshLayout(shard=2, context=2, tensor=1, expert=2),
                   "ep4_cp2": MeshLayout(shard=2, context=2, tensor=1, expert=4)}
SEQUENCES, LENGTH = 4, 8  # a global batch of 4 sequences of 8 positions: 32 tokens, as above
#: A 2-stage pipeline, each stage's experts over its 2 data-parallel processes.
PIPELINE_LAYOUT = MeshLayout(pipeline=2, shard=2, tensor=1, expert=2)
#: `pp2x2_ep2`: 4 MoE blocks, a stage each, 2 stages on every process (interleaved 1F1B).
INTERLEAVED_BLOCKS = 4


class Experts(nn.Module):
    """Stacked experts: `forward(tokens, num_tokens_per_expert)`, tokens sorted by expert."""

    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, FFN) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, FFN, HIDDEN) / FFN**0.5)

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(tokens, num_tokens_per_expert.tolist())
        return torch.cat([torch.tanh(chunk @ self.w1[e]) @ self.w2[e] for e, chunk in enumerate(chunks)])


def mixed(router: nn.Module, experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Each token's top-2 experts' outputs weighted by the router's softmax, summed."""
    return mixed_by(torch.softmax(router(h), dim=-1), experts, h)


def mixed_by(probs: torch.Tensor, experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """`mixed` from the router's probabilities."""
    weights, chosen = probs.topk(TOP_K, dim=-1)
    flat = chosen.flatten()                                  # one (token, slot) per row
    order = torch.argsort(flat, stable=True)                 # grouped by expert
    routed = experts(h.repeat_interleave(TOP_K, dim=0)[order], torch.bincount(flat, minlength=EXPERTS))
    unsorted = torch.empty_like(routed).index_copy(0, order, routed)
    return (unsorted.view(len(h), TOP_K, HIDDEN) * weights.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """Embedding, a top-2 softmax router over the experts, their weighted sum, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(HIDDEN, 1)

    def chosen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.router(self.embed(x)), dim=-1).topk(TOP_K, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(-1, HIDDEN)  # one row a token (a sequence's positions too)
        probs = torch.softmax(self.router(h), dim=-1)
        self.routing = (probs, probs.topk(TOP_K, dim=-1).indices)  # for a load-balancing loss
        return self.head(h + mixed_by(probs, self.experts, h)).reshape(*x.shape[:-1], 1)


class MoEBlock(nn.Module):
    """A residual MoE block: a router and its experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + mixed(self.router, self.experts, h)


class StackedMoE(nn.Module):
    """An embedding, `blocks` MoE blocks and a head: cut into pipeline stages at `"blocks.1"`, ..."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([MoEBlock() for _ in range(blocks)])
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # on the second stage a stand-in that hands its input on
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loads(self, x: torch.Tensor) -> torch.Tensor:
        """How many (token, slot) pairs of `x` each block's router sends to each expert: `[blocks, EXPERTS]`."""
        counts, h = [], self.embed(x)
        for block in self.blocks:
            counts.append(torch.bincount(block.router(h).topk(TOP_K, dim=-1).indices.flatten(), minlength=EXPERTS))
            h = block(h)
        return torch.stack(counts)


def parallelize(model: MoE, device_mesh) -> nn.Module:
    """The user's function, the same under every layout: the experts over `"expert_parallel"` and,
    where it has several processes, FSDP2 over `"expert_data_parallel"` (which averages their
    gradients there); the embedding and the router tensor parallel where `"tensor_parallel"` has
    several processes; the rest FSDP2 over `"data_parallel"`."""
    if device_mesh["tensor_parallel"].size() > 1:
        gathered = ColwiseParallel(output_layouts=Replicate())  # both processes see the whole output
        parallelize_module(model, device_mesh["tensor_parallel"], {"embed": gathered, "router": gathered})
    parallelize_module(model.experts, device_mesh["expert_parallel"], ExpertParallel())
    if device_mesh["expert_data_parallel"].size() > 1:
        fully_shard(model.experts, mesh=device_mesh["expert_data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"], ignored_params=set(model.experts.parameters()))


def parallelize_stage(model: StackedMoE, device_mesh) -> nn.Module:
    """The user's function under the pipeline, applied to each stage's part (which holds its own
    blocks only): each block's experts over `"expert_parallel"`, the rest FSDP2 over `"data_parallel"`."""
    experts = [module for module in model.modules() if isinstance(module, Experts)]
    for module in experts:
        parallelize_module(module, device_mesh["expert_parallel"], ExpertParallel())
    return fully_shard(model, mesh=device_mesh["data_parallel"], ignored_params={p for m in experts
                                                                                for p in m.parameters()})


def make_model(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)  # every process's first batch reaches every EP 4 process
    return (torch.randn(STEPS * GLOBAL_BATCH, IN, generator=generator),
            torch.randn(STEPS * GLOBAL_BATCH, 1, generator=generator))


def probe() -> torch.Tensor:
    """Inputs whose logits are compared where a checkpoint was saved and where it was loaded."""
    return torch.randn(12, IN, generator=torch.Generator().manual_seed(99))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: unlike AdamW, the final weights show a gradient's scale.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def rows(step: int, replica: int, replicas: int, micro: int) -> slice:
    """The rows of `step`'s global batch that data-parallel `replica` trains on in micro-batch `micro`."""
    per_micro = GLOBAL_BATCH // replicas // ACCUMULATE
    start = step * GLOBAL_BATCH + (replica * ACCUMULATE + micro) * per_micro
    return slice(start, start + per_micro)


def plain_pytorch(initial: dict[str, torch.Tensor], load_replicas: list[int] | None = None,
                  replicas: int = WORLD, balance: float = 0.0) -> dict:
    """One plain process over the whole global batches, clipped with `clip_grad_norm_`: the
    reference. `loads` counts the router's choices over the rows of `load_replicas` (all by default);
    `balance` weighs the load-balancing loss as `train_step` adds it."""
    model = make_model()
    model.load_state_dict(initial)
    optimizer = make_optimizer(model)
    x, _ = make_data()
    losses, gradients, norms, loads = [], {}, [], []
    for step in range(STEPS):
        counted = [rows(step, r, replicas, m) for r in (load_replicas or range(replicas)) for m in range(ACCUMULATE)]
        with torch.no_grad():
            loads.append(sum(torch.bincount(model.chosen(x[part]).flatten(), minlength=EXPERTS) for part in counted))
        loss, norm, first = plain_step(model, optimizer, step, replicas, balance)
        gradients = gradients or first
        losses.append(loss)
        norms.append(norm)
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "gradients": gradients, "norms": norms, "loads": torch.stack(loads)}


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, replicas: int = WORLD,
               balance: float = 0.0) -> tuple[float, float, dict]:
    """One plain step over global batch `step`, clipped: its loss, the norm and the gradients before
    clipping. With `balance`, the load-balancing loss of each micro-batch round (the rows every
    replica trains on in micro-batch `m`, as `train_step` computes it over the processes), averaged."""
    x, y = make_data()
    batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x[batch]), y[batch])
    if balance:
        probs, chosen = model.routing
        for micro in range(ACCUMULATE):
            taken = torch.cat([torch.arange(GLOBAL_BATCH)[rows(0, r, replicas, micro)] for r in range(replicas)])
            loss = loss + balance * load_balancing_loss(probs[taken], chosen[taken]) / ACCUMULATE
    loss.backward()
    gradients = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    optimizer.step()
    return loss.item(), norm, gradients


def plain_pipelined(initial: dict[str, torch.Tensor], blocks: int = 2) -> dict:
    """One plain process over the whole global batches, as `pipelined` trains and evaluates them: the reference."""
    torch.manual_seed(0)
    model = StackedMoE(blocks)
    model.load_state_dict(initial)
    optimizer = make_optimizer(model)
    x, y = make_data()
    losses, norms, loads, gradients = [], [], [], {}
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        with torch.no_grad():
            loads.append(model.loads(x[batch]))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        gradients = gradients or {k: p.grad.clone() for k, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        evaluation = (nn.functional.mse_loss(model(x[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).item(),
                      model.loads(x[:GLOBAL_BATCH]))
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "norms": norms, "gradients": gradients, "loads": torch.stack(loads, dim=1), "evaluation": evaluation}


def sequences() -> tuple[torch.Tensor, torch.Tensor]:
    """`STEPS` global batches of `SEQUENCES` sequences `[LENGTH, IN]` and their targets `[LENGTH, 1]`."""
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS * SEQUENCES, LENGTH, IN, generator=generator),
            torch.randn(STEPS * SEQUENCES, LENGTH, 1, generator=generator))


def parallelize_with_context(model: MoE, device_mesh) -> nn.Module:
    """The user's function under context parallelism: the experts over `"expert_parallel"` (and
    FSDP2 over `"expert_data_parallel"` where it has several processes), the rest FSDP2 over
    `"data_context_parallel"`, which averages the gradients of every process's part of the batch."""
    parallelize_module(model.experts, device_mesh["expert_parallel"], ExpertParallel())
    if device_mesh["expert_data_parallel"].size() > 1:
        fully_shard(model.experts, mesh=device_mesh["expert_data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_context_parallel"], ignored_params=set(model.experts.parameters()))


def plain_with_context(initial: dict[str, torch.Tensor], batches: list[list[int]]) -> dict:
    """One plain process over the whole sequences of each global batch (`batches`: their indices)."""
    model = make_model()
    model.load_state_dict(initial)
    optimizer = make_optimizer(model)
    x, y = sequences()
    losses, gradients, loads = [], {}, []
    for rows in batches:
        with torch.no_grad():
            loads.append(torch.bincount(model.chosen(x[rows]).flatten(), minlength=EXPERTS))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        gradients = gradients or {k: p.grad.clone() for k, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "gradients": gradients, "loads": torch.stack(loads)}


def with_context(layout: MeshLayout) -> dict:
    """The user's loop under `layout`: the set-up loader hands each process its data-parallel
    replica's sequences, cut along the sequence for its context-parallel rank."""
    lite = LightningLite(accelerator="cpu", devices=WORLD,
                         strategy=ModelParallelStrategy(parallelize_with_context, mesh=layout))
    lite.launch()
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = lite.setup(model, make_optimizer(model))
    x, y = sequences()
    replicas = lite.strategy.device_mesh["data_parallel"].size()
    loader = lite.setup_dataloaders(DataLoader(TensorDataset(x, y, torch.arange(len(x))),
                                               batch_size=SEQUENCES // replicas))
    losses, gradients, loads, batches, tokens = [], {}, [], [], []
    for part_x, part_y, index in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(part_x), part_y)
        lite.backward(loss)
        gradients = gradients or full_gradients(model)
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
        loads.append(expert_load(model.experts))
        batches.append(sorted(lite.all_gather(index).flatten().unique().tolist()))
        tokens.append(part_x.shape[1])
    return {"initial": initial, "final": full_weights(model), "losses": losses, "gradients": gradients,
            "loads": torch.stack(loads), "batches": batches, "positions": tokens,
            "dim_names": list(lite.strategy.device_mesh.mesh_dim_names), "experts": placements(model.experts.w1)}


def pipelined(out: Path | None, blocks: int = 2, **schedule: Any) -> dict:
    """`PIPELINE_LAYOUT`: the user's loop, `loss = model(x, target=y)`, backward, clipping, the step,
    then an evaluation under `torch.no_grad()` and (with `out`) a save there; every stage's whole
    weights and first gradients, and each block's load per step (the evaluation's last). The model
    has `blocks` MoE blocks, a stage each (`schedule`: e.g. 2 stages per process, interleaved)."""
    strategy = ModelParallelStrategy(parallelize_stage, mesh=PIPELINE_LAYOUT,
                                     split_points=[f"blocks.{b}" for b in range(1, blocks)],
                                     microbatches=2, loss_fn=nn.functional.mse_loss, **schedule)
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=WORLD)
    lite.launch()
    torch.manual_seed(0)
    model = StackedMoE(blocks)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = lite.setup(model, make_optimizer(model))
    mesh = lite.strategy.device_mesh
    replica, replicas = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()
    per_replica = GLOBAL_BATCH // replicas
    x, y = make_data()
    losses, norms, loads, gradients = [], [], [], {}
    for step in range(STEPS):
        part = slice(step * GLOBAL_BATCH + replica * per_replica, step * GLOBAL_BATCH + (replica + 1) * per_replica)
        optimizer.zero_grad()
        loss = model(x[part], target=y[part])  # the schedule: every micro-batch's forward and backward
        lite.backward(loss)
        gradients = gradients or full_gradients(model)
        norms.append(lite.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
        loads.append(stage_loads(model))
    with torch.no_grad():  # a forward-only schedule of its own: global batch 0's loss and loads
        part = slice(replica * per_replica, (replica + 1) * per_replica)
        evaluation = lite.all_reduce(model(x[part], target=y[part]), reduce_op="mean").item()
        loads.append(stage_loads(model))
    if out is not None:
        lite.save({"model": model, "optimizer": optimizer}, out)
    every_stage = [None] * WORLD
    dist.all_gather_object(every_stage, (full_weights(model), gradients, loads))
    block_loads = {block: torch.stack([step[block] for step in stage_loads])
                   for _, _, stage_loads in every_stage for block in stage_loads[0]}
    return {"initial": initial, "losses": losses, "norms": norms, "evaluation": evaluation,
            "final": {k: v for weights, _, _ in every_stage for k, v in weights.items()},
            "gradients": {k: v for _, grads, _ in every_stage for k, v in grads.items()},
            "loads": torch.stack([block_loads[block] for block in sorted(block_loads)]),
            "local_keys": sorted(model.state_dict()), "experts": placements(next(iter(model.blocks)).experts.w1)}


def stage_loads(model: nn.Module) -> dict[int, torch.Tensor]:
    """The loads of the blocks this process's stages hold, by block index (the stages keep the
    whole model's names: `blocks.1.experts` on the second of two stages)."""
    return {int(name.split(".")[1]): expert_load(module) for name, module in model.named_modules()
            if name.startswith("blocks.") and name.endswith(".experts")}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient; one that got none is left out (and the comparison says so)."""
    return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for k, p in model.named_parameters() if p.grad is not None}


def launched(layout: MeshLayout) -> LightningLite:
    lite = LightningLite(accelerator="cpu", strategy=ModelParallelStrategy(parallelize, mesh=layout), devices=WORLD)
    lite.launch()  # the first call starts the processes; later ones find them started
    return lite


def train_step(lite: LightningLite, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
               gradients: bool = False, balance: float = 0.0) -> tuple[float, float, dict]:
    """One optimizer step on this process's part of global batch `step`: `ACCUMULATE` micro-batches
    (the gradients synchronised on the last), clipping, the step. Returns the global batch's loss,
    the norm before clipping and (if asked) the whole gradients before clipping."""
    x, y = make_data()
    data = lite.strategy.device_mesh["data_parallel"]
    replica, replicas = data.get_local_rank(), data.size()
    optimizer.zero_grad()
    total = torch.zeros(())
    for micro in range(ACCUMULATE):
        part = rows(step, replica, replicas, micro)
        with lite.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
            loss = nn.functional.mse_loss(model(x[part]), y[part]) / ACCUMULATE
            if balance:  # over every data-parallel process's micro-batch, not this process's tokens
                loss = loss + balance * load_balancing_loss(*model.routing, model.experts) / ACCUMULATE
            lite.backward(loss)
        total += loss.detach()
    whole = full_gradients(model) if gradients else {}
    norm = lite.clip_gradients(model, optimizer, max_norm=MAX_NORM).item()
    optimizer.step()
    return lite.all_reduce(total, reduce_op="mean").item(), norm, whole


def train(lite: LightningLite, balance: float = 0.0) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    """The user's loop: `STEPS` steps of `train_step` (`balance`: the load-balancing loss's weight),
    the load per expert after each."""
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = lite.setup(model, make_optimizer(model))
    mesh = lite.strategy.device_mesh
    replica, replicas = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()
    losses, gradients, norms, loads = [], {}, [], []
    for step in range(STEPS):
        loss, norm, first = train_step(lite, model, optimizer, step, gradients=not gradients, balance=balance)
        gradients = gradients or first
        losses.append(loss)
        norms.append(norm)
        loads.append(expert_load(model.experts))  # this step's tokens per expert, over the expert dimension
    # The data-parallel ranks whose tokens rank 0's experts receive: its expert-parallel group's.
    members = [None] * mesh["expert_parallel"].size()
    dist.all_gather_object(members, replica, group=mesh["expert_parallel"].get_group())
    result = {"initial": initial, "final": full_weights(model), "losses": losses, "gradients": gradients,
              "norms": norms, "loads": torch.stack(loads), "load_replicas": sorted(members), "replicas": replicas,
              "dim_names": list(mesh.mesh_dim_names), "experts": placements(model.experts.w1), "balance": balance}
    return result, model, optimizer


def placements(param: torch.Tensor) -> dict:
    """Where a parameter lives: its mesh's dimensions, its placements and this process's shape."""
    return {"dims": list(param.device_mesh.mesh_dim_names),
            "placements": [f"{type(p).__name__}({p.dim})" for p in param.placements],
            "local": list(param.to_local().shape)}


def logits(model: nn.Module, rank: int = 0) -> torch.Tensor:
    """The probe's logits from rank 0's tokens; the other processes send none, so each expert
    computes on the same rows as in one plain process (bit for bit)."""
    with torch.no_grad():
        return model(probe() if rank == 0 else probe()[:0])


def parallelize_without_expert_data(model: MoE, device_mesh) -> nn.Module:
    """`parallelize` without `fully_shard` over `"expert_data_parallel"`: under EP 2 x data 2
    nothing would average the experts' gradients over its two groups."""
    parallelize_module(model.experts, device_mesh["expert_parallel"], ExpertParallel())
    return fully_shard(model, mesh=device_mesh["data_parallel"], ignored_params=set(model.experts.parameters()))


def refusals() -> dict[str, str]:
    """What is refused on 4 processes, by case: its message."""
    lite = launched(LAYOUTS["ep4"])
    unaveraged = LightningLite(accelerator="cpu", devices=WORLD, strategy=ModelParallelStrategy(
        parallelize_without_expert_data, mesh=LAYOUTS["ep2_dp2"]))
    unaveraged.launch()
    cases = {
        "unaveraged": lambda: unaveraged.setup(make_model()),
        "uneven": lambda: parallelize_module(Experts(6), lite.strategy.device_mesh["expert_parallel"],
                                             ExpertParallel()),
        "layout": lambda: LightningLite(accelerator="cpu", devices=WORLD,
                                        strategy=ModelParallelStrategy(parallelize, mesh=MeshLayout(expert=3))),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except LiteError as error:
            messages[name] = str(error)
    return messages


def main(out: Path) -> None:
    results: dict = {}
    for name in ("ep2_dp2", "ep2_tp2"):
        results[name], _, _ = train(launched(LAYOUTS[name]))
    results["ep2_dp2_balanced"], _, _ = train(launched(LAYOUTS["ep2_dp2"]), balance=BALANCE)
    for name, layout in CONTEXT_LAYOUTS.items():
        results[name] = with_context(layout)
    lite = launched(LAYOUTS["ep4"])
    results["ep4"], model, optimizer = train(lite)
    results["ep4"]["logits"] = logits(model, lite.global_rank)
    lite.save({"model": model, "optimizer": optimizer}, out / "ckpt_ep4")
    results["checkpoint"] = str(out / "ckpt_ep4")
    lite = launched(LAYOUTS["ep2_dp2"])
    model = make_model(seed=5)  # other weights than those saved: the load must replace every one
    model, optimizer = lite.setup(model, make_optimizer(model))
    lite.load(out / "ckpt_ep4", {"model": model, "optimizer": optimizer})
    moved = {"loaded": full_weights(model), "logits": logits(model, lite.global_rank),
             "experts": placements(model.experts.w1)}
    # One more step on global batch 0 from the loaded weights and momentum.
    moved["loss"], moved["norm"], _ = train_step(lite, model, optimizer, 0)
    results["moved"] = {**moved, "final": full_weights(model)}
    results["pp2_ep2"] = {**pipelined(out / "ckpt_pp2_ep2"), "checkpoint": str(out / "ckpt_pp2_ep2")}
    results["pp2x2_ep2"] = pipelined(None, blocks=INTERLEAVED_BLOCKS, pipeline_schedule="Interleaved1F1B",
                                     stages_per_rank=2)
    results["refusals"] = refusals()
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
