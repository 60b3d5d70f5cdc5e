"""Expert parallelism (`lite_core.parallel.ExpertParallel`) on 2 processes: a hand-written tiny
Mixture-of-Experts (router, top-2 softmax routing, stacked experts run by a per-expert loop, no
capacity factor so no token is dropped), its 4 experts sharded over `ModelParallelStrategy`'s
data-parallel dimension (EP 2), each process training on its own half of every global batch with
an ordinary AdamW loop. Twice: the experts sharded over the data-parallel dimension
itself, and over the `"expert_parallel"` dimension of `MeshLayout(shard=2, expert=2)`.

    python expert_parallel_job.py OUT_DIR

Rank 0 writes `OUT_DIR/results.pt`: per way, the mesh's names, the initial weights, the first
step's full gradients, the final full weights and the global batch's losses, for comparison with one
plain PyTorch process (`plain_pytorch`); and the messages of what `ExpertParallel` refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from lite_core import LightningLite
from lite_core.errors import LiteError
from lite_core.parallel import ExpertParallel, MeshLayout
from lite_core.strategies import ModelParallelStrategy

torch.set_num_threads(1)

WORLD = 2
GLOBAL_BATCH = 16
STEPS = 4
LR = 0.05
IN, HIDDEN, FFN, EXPERTS, TOP_K = 4, 8, 16, 4, 2


class Experts(nn.Module):
    """Stacked experts: `forward(tokens, num_tokens_per_expert)`, tokens sorted by expert."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN**0.5)

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(tokens, num_tokens_per_expert.tolist())
        return torch.cat([torch.tanh(chunk @ self.w1[e]) @ self.w2[e] for e, chunk in enumerate(chunks)])


class MoE(nn.Module):
    """Embedding, a top-2 softmax router over the experts, their weighted sum, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        weights, chosen = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
        flat = chosen.flatten()                                  # one (token, slot) per row
        order = torch.argsort(flat, stable=True)                 # grouped by expert
        routed = self.experts(h.repeat_interleave(TOP_K, dim=0)[order], torch.bincount(flat, minlength=EXPERTS))
        unsorted = torch.empty_like(routed).index_copy(0, order, routed)
        mixed = (unsorted.view(len(x), TOP_K, HIDDEN) * weights.unsqueeze(-1)).sum(1)
        return self.head(h + mixed)


def parallelize(model: MoE, device_mesh) -> nn.Module:
    """The user's function: experts sharded over the data-parallel dimension (EP), the other
    weights FSDP2 over the same dimension, which averages their gradients."""
    dp = device_mesh["data_parallel"]
    parallelize_module(model.experts, dp, ExpertParallel())
    return fully_shard(model, mesh=dp, ignored_params=set(model.experts.parameters()))


def parallelize_on_the_expert_dimension(model: MoE, device_mesh) -> nn.Module:
    """The same with `MeshLayout(expert=...)`: the experts over its `"expert_parallel"` dimension."""
    parallelize_module(model.experts, device_mesh["expert_parallel"], ExpertParallel())
    return fully_shard(model, mesh=device_mesh["data_parallel"], ignored_params=set(model.experts.parameters()))


def make_model() -> MoE:
    torch.manual_seed(0)
    return MoE()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return (torch.randn(STEPS * GLOBAL_BATCH, IN, generator=generator),
            torch.randn(STEPS * GLOBAL_BATCH, 1, generator=generator))


def plain_pytorch(initial: dict[str, torch.Tensor]) -> dict:
    """One plain process over the whole global batches: the reference."""
    model = make_model()
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data()
    losses, gradients = [], {}
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        gradients = gradients or full_gradients(model)
        optimizer.step()
        losses.append(loss.item())
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "gradients": gradients}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (AdamW hides a gradient's scale, this does not)."""
    return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for k, p in model.named_parameters()}


def train(lite: LightningLite) -> dict:
    """The user's loop on this process's half of every global batch."""
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = lite.setup(model, optimizer)
    x, y = make_data()
    half = GLOBAL_BATCH // WORLD
    rank = lite.strategy.device_mesh["data_parallel"].get_local_rank()
    losses, gradients = [], {}
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + rank * half
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[start:start + half]), y[start:start + half])
        lite.backward(loss)
        gradients = gradients or full_gradients(model)
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"initial": initial, "final": full_weights(model), "losses": losses, "gradients": gradients,
            "dim_names": list(lite.strategy.device_mesh.mesh_dim_names)}


class GroupedExperts(nn.Module):
    """The same contract computed by `torch._grouped_mm` (bfloat16 on CPU)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, width, width, dtype=torch.bfloat16) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, width, width, dtype=torch.bfloat16) / width**0.5)

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
        return torch._grouped_mm(torch.tanh(torch._grouped_mm(tokens, self.w1, offs=offsets)), self.w2, offs=offsets)


def grouped(lite: LightningLite) -> dict[str, torch.Tensor]:
    """`GroupedExperts` under EP 2 against the whole module on this process: output and token gradients."""
    torch.manual_seed(1)
    whole, sharded = GroupedExperts(), GroupedExperts()
    sharded.load_state_dict(whole.state_dict())
    parallelize_module(sharded, lite.strategy.device_mesh["data_parallel"], ExpertParallel())
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    counts = torch.randint(0, 6, (EXPERTS,), generator=generator)
    tokens = torch.randn(int(counts.sum()), 16, generator=generator, dtype=torch.bfloat16)
    results = {}
    for name, module in (("whole", whole), ("sharded", sharded)):
        x = tokens.clone().requires_grad_()
        out = module(x, counts)
        out.float().pow(2).sum().backward()
        results[name], results[f"{name}_grad"] = out.detach().float(), x.grad.float()
    return results


class _ThreeExperts(Experts):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(3, HIDDEN, FFN))
        self.w2 = nn.Parameter(torch.zeros(3, FFN, HIDDEN))


def refusals(lite: LightningLite) -> dict[str, str]:
    """What `ExpertParallel` refuses, by case: its message."""
    dp = lite.strategy.device_mesh["data_parallel"]
    cases = {
        "uneven": lambda: parallelize_module(_ThreeExperts(), dp, ExpertParallel()),
        "not_stacked": lambda: parallelize_module(nn.Linear(HIDDEN, HIDDEN), dp, ExpertParallel()),
        "two_dims": lambda: parallelize_module(Experts(), lite.strategy.device_mesh, ExpertParallel()),
        "call": lambda: parallelize_module(Experts(), dp, ExpertParallel())(torch.zeros(2, HIDDEN)),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except LiteError as error:
            messages[name] = str(error)
    return messages


def launched(strategy: ModelParallelStrategy) -> LightningLite:
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=WORLD)
    lite.launch()
    return lite


def main(out: Path) -> None:
    lite = launched(ModelParallelStrategy(parallelize, data_parallel_size=WORLD, tensor_parallel_size=1))
    results = {"data_parallel": train(lite), "refusals": refusals(lite), "grouped": grouped(lite)}
    lite = launched(ModelParallelStrategy(parallelize_on_the_expert_dimension,
                                          mesh=MeshLayout(shard=WORLD, tensor=1, expert=WORLD)))
    results["expert_parallel"] = train(lite)
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
