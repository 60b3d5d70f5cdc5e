"""Worker: per-step time of Lite's expert parallelism (`ExpertParallel` under
`ModelParallelStrategy`) vs the same job written by hand with torch's own APIs, on 2 processes,
interleaved in one job.

Started by `expert_parallel.py` as `python _ep_worker.py ...`. Lite starts the second rank by
running this script again and creates the process group (as in `_ddp_worker.py` and
`_tp_worker.py`: the comparison is the step, not the start-up). On every rank, from the same
weights:

* `plain`   - written by hand: a `DeviceMesh` of its own (`init_device_mesh`), the stacked
  experts' weights sharded as `DTensor`s with `distribute_tensor(..., [Shard(0)])`, a dispatch
  written here from `all_to_all_single` (the counts) and `all_to_all_single_autograd` (the tokens
  out and the results back), the experts' gradients divided by the number of processes after
  backward, the other weights under FSDP2 `fully_shard` (the experts in `ignored_params`).
* `lite`    - the same model set up by `LightningLite(strategy=ModelParallelStrategy(parallelize))`
  whose `parallelize` applies `ExpertParallel` to each layer's experts and the same `fully_shard`;
  stepped with `lite.backward(loss)` and the set-up optimizer.
* `control` - (with `--control`) a second hand-written copy: the A/A noise floor.

Before timing, every arm trains `--check-steps` steps on the same batches and the losses (and
the weights after them) are compared; a difference above `--tolerance` exits 3 with the numbers.
Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Arm, call_record, make_optimizer, per_model, run_interleaved, timer_floor_ns, write_json  # noqa: E402
from _two_ranks import is_node, run_as_nodes, share_a_device, two_ranks  # noqa: E402


class Shape:
    """The MoE's sizes (set from the command line)."""

    hidden = 256
    ffn = 512
    experts = 8
    top_k = 2
    layers = 2
    tokens = 256  # per process and step
    grouped = False  # torch._grouped_mm instead of a loop over the experts


def expert_mlp(tokens: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The experts' computation on tokens sorted by expert (`counts[e]` rows for expert `e`)."""
    if Shape.grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(F.silu(torch._grouped_mm(tokens, w1, offs=offsets)), w2, offs=offsets)
    chunks = torch.split(tokens, counts.tolist())
    return torch.cat([F.silu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(chunks)])


class Experts(nn.Module):
    """Stacked experts under the contract `forward(tokens, num_tokens_per_expert)`."""

    def __init__(self) -> None:
        super().__init__()
        s = Shape
        self.w1 = nn.Parameter(torch.randn(s.experts, s.hidden, s.ffn) / s.hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(s.experts, s.ffn, s.hidden) / s.ffn**0.5)

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return expert_mlp(tokens, num_tokens_per_expert, self.w1, self.w2)


class MoELayer(nn.Module):
    """A top-k softmax router, the tokens sorted by expert, the experts, their weighted sum (residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(Shape.hidden, Shape.experts, bias=False)
        self.experts = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        k = Shape.top_k
        weights, chosen = torch.softmax(self.router(h), dim=-1).topk(k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=Shape.experts)
        out = self.experts(h.repeat_interleave(k, dim=0)[order], counts)
        out = torch.empty_like(out).index_copy(0, order, out)
        return h + (out.view(len(h), k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(1)


class MoE(nn.Module):
    """Input projection, `Shape.layers` MoE layers, output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(Shape.hidden, Shape.hidden)
        self.layers = nn.ModuleList(MoELayer() for _ in range(Shape.layers))
        self.head = nn.Linear(Shape.hidden, Shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# -- Lite's job ------------------------------------------------------------------------------------
def parallelize(model: MoE, device_mesh) -> nn.Module:
    """The user's function for Lite: EP over the data-parallel dimension, FSDP2 for the rest."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lite_core.parallel import ExpertParallel

    dp = device_mesh["data_parallel"]
    experts = [layer.experts for layer in model.layers]
    for module in experts:
        parallelize_module(module, dp, ExpertParallel())
    return fully_shard(model, mesh=dp, ignored_params={p for m in experts for p in m.parameters()})


# -- the same job by hand ----------------------------------------------------------------------------
class ShardedExperts(nn.Module):
    """Written by hand from torch's APIs: this process's share of the stacked experts (`DTensor`s,
    `Shard(0)`) and the token exchange around them."""

    def __init__(self, whole: Experts, mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.w1 = nn.Parameter(distribute_tensor(whole.w1.detach(), mesh, [Shard(0)]))
        self.w2 = nn.Parameter(distribute_tensor(whole.w2.detach(), mesh, [Shard(0)]))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        # counts[e] for every global expert; process r holds experts r*E/n ... (r+1)*E/n - 1.
        to_send = counts.view(self.size, -1)
        to_receive = torch.empty_like(to_send)
        dist.all_to_all_single(to_receive, to_send, group=self.group)  # row r: what process r sends me
        send_sizes, receive_sizes = to_send.sum(1).tolist(), to_receive.sum(1).tolist()
        received = all_to_all_single_autograd(tokens, receive_sizes, send_sizes, self.group)
        # `received` is (source process, local expert) chunks: regroup it by local expert.
        local_experts = to_receive.shape[1]
        expert_of_row = torch.repeat_interleave(torch.arange(local_experts, device=counts.device).repeat(self.size),
                                                to_receive.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = expert_mlp(received[by_expert], to_receive.sum(0), self.w1.to_local(), self.w2.to_local())
        out = torch.empty_like(out).index_copy(0, by_expert, out)  # back to arrival order
        return all_to_all_single_autograd(out, send_sizes, receive_sizes, self.group)


def by_hand(base: MoE, mesh) -> tuple[nn.Module, list[torch.Tensor]]:
    """The model parallelised by hand on `mesh` (1-D), and its expert parameters."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for layer in model.layers:
        layer.experts = ShardedExperts(layer.experts, mesh)
    experts = [p for layer in model.layers for p in layer.experts.parameters()]
    return fully_shard(model, mesh=mesh, ignored_params=set(experts)), experts


def hand_backward(experts: list[torch.Tensor], size: int):
    """`loss.backward()`, then the experts' gradients divided by the number of processes: each
    expert saw every process's tokens, and each process's loss is a mean over its own, so the
    sum the all-to-all's backward brings is `size` times the gradient of the global mean."""

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        with torch.no_grad():
            torch._foreach_div_([p.grad.to_local() for p in experts], size)

    return backward


def build_arms(lite, base: MoE, mesh, control: bool) -> list[Arm]:
    arms = []
    for name in ("plain", "control") if control else ("plain",):
        model, experts = by_hand(base, mesh)
        arms.append(Arm(name, model, make_optimizer(model), hand_backward(experts, mesh.size())))
    lite_model = copy.deepcopy(base)
    wrapped_model, wrapped_optimizer = lite.setup(lite_model, make_optimizer(lite_model))
    arms.insert(1, Arm("lite", wrapped_model, wrapped_optimizer, lite.backward))
    return arms


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    named = {name: p for name, p in model.named_parameters()}
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for name, p in sorted(named.items())}


def check_same(arms: list[Arm], batches, steps: int, tolerance: float, rank: int) -> dict[str, float]:
    """Train every arm `steps` steps on the same batches; every arm's losses and final weights must
    equal the plain arm's within `tolerance` (absolute), on every rank; otherwise exit 3 with the
    numbers. Returns the largest differences and the plain arm's losses."""
    losses = {arm.name: [] for arm in arms}
    for arm in arms:
        for index in range(steps):
            x, y = batches[index % len(batches)]
            arm.optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(arm.model(x), y)
            arm.backward(loss)
            arm.optimizer.step()
            losses[arm.name].append(loss.item())
    reference = full_weights(arms[0].model)
    report = {}
    for arm in arms[1:]:
        loss_diff = max(abs(a - b) for a, b in zip(losses[arm.name], losses["plain"]))
        weights = full_weights(arm.model)
        if set(weights) != set(reference):
            raise SystemExit(f"rank {rank}: {arm.name} has parameters {sorted(weights)}, plain {sorted(reference)}")
        weight_diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        worst = torch.tensor([loss_diff, weight_diff], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        report[f"{arm.name}_max_loss_difference"] = worst[0].item()
        report[f"{arm.name}_max_weight_difference"] = worst[1].item()
        if worst.max().item() > tolerance:
            print(f"rank {rank}: MISMATCH, {arm.name} differs from the hand-written job: largest loss difference"
                  f" {worst[0].item():.3e}, weight difference {worst[1].item():.3e} (tolerance {tolerance:g});"
                  f" losses {arm.name} {losses[arm.name]} vs plain {losses['plain']}", file=sys.stderr, flush=True)
            sys.exit(3)
    report["losses"] = losses["plain"]
    return report


def cpu_blocks(arms: list[Arm], batches, reps: int, steps: int, before_block) -> dict[str, list[float]]:
    """Like `run_interleaved`, but each block's CPU time of this process (`time.process_time_ns`)
    per step: the work this process did, without the time it waited for the other process or for a
    core another job held, so it moves far less with the machine's load than wall time does."""
    import gc
    import time

    per_step: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for rep in range(reps):
        shift = rep % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            gc.collect()
            before_block()
            gc.disable()
            try:
                start = time.process_time_ns()
                arm.steps(batches, steps)
                per_step[arm.name].append((time.process_time_ns() - start) / steps)
            finally:
                gc.enable()
    return per_step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--grouped", action="store_true", help="experts computed with torch._grouped_mm")
    parser.add_argument("--hidden", type=int, default=Shape.hidden)
    parser.add_argument("--ffn", type=int, default=Shape.ffn)
    parser.add_argument("--experts", type=int, default=Shape.experts)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--tokens", type=int, default=Shape.tokens, help="tokens per process and step")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each rank")
    parser.add_argument("--reps", default="12", help="interleaved rounds")
    parser.add_argument("--steps", default="5", help="timed steps per block")
    parser.add_argument("--warmup", default="3", help="untimed steps per arm")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the equality check before timing")
    parser.add_argument("--tolerance", type=float, default=None, help="default 1e-6 (float32), 2e-2 (bfloat16)")
    parser.add_argument("--calls", action="store_true", help="also count Python calls per step (sys.setprofile)")
    parser.add_argument("--cpu-time", action="store_true", help="also time blocks by this process's CPU time")
    parser.add_argument("--control", action="store_true", help="add a second hand-written arm (A/A noise control)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and share_a_device("cuda") and not is_node():
        return run_as_nodes([__file__, *sys.argv[1:]])  # one GPU: two one-process nodes sharing it
    torch.set_num_threads(args.threads)
    Shape.hidden, Shape.ffn, Shape.experts, Shape.layers, Shape.tokens = (
        args.hidden, args.ffn, args.experts, args.layers, args.tokens)
    Shape.grouped = args.grouped
    dtype = getattr(torch, args.dtype)
    tolerance = args.tolerance if args.tolerance is not None else (1e-6 if dtype == torch.float32 else 2e-2)
    from torch.distributed.device_mesh import init_device_mesh

    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    ranks = two_ranks() if args.device == "cuda" else {"devices": 2}
    precision = "32-true" if dtype == torch.float32 else "bf16-true"
    # Both processes data parallel (the default would make them tensor parallel), the experts over them.
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    lite = LightningLite(accelerator=args.device, strategy=strategy, precision=precision, **ranks)
    lite.launch()  # rank 0 starts rank 1 (this script again); both continue from here
    device = lite.device
    rank = dist.get_rank()
    # The hand-written job's own mesh over the two processes.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    base = MoE().to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(1 + rank)  # each process its own tokens
    batches = [(torch.randn(Shape.tokens, Shape.hidden, generator=generator).to(device, dtype),
                torch.randn(Shape.tokens, Shape.hidden, generator=generator).to(device, dtype)) for _ in range(4)]
    arms = build_arms(lite, base, mesh, args.control)
    check = check_same(arms, batches, args.check_steps, tolerance, rank)
    # On a GPU every step waits for its own work: the splits of each all-to-all are read on the host
    # (`tolist()`), so a step cannot run ahead of the device by more than one layer's tail.
    before_block = (lambda: (torch.cuda.synchronize(), dist.barrier())) if device.type == "cuda" else dist.barrier
    reps, steps, warmup = (per_model(v, 1)[0] for v in (args.reps, args.steps, args.warmup))
    run_interleaved(arms, batches, warmup=warmup, reps=reps, steps=steps, before_block=before_block)
    description = (f"MoE {Shape.layers} layers, {Shape.experts} experts top-{Shape.top_k}, hidden {Shape.hidden},"
                   f" ffn {Shape.ffn}, {Shape.tokens} tokens/process, {args.dtype},"
                   f" {'grouped_mm' if Shape.grouped else 'loop over experts'}, EP {dist.get_world_size()}")
    entry = {"description": description, "reps": reps, "steps_per_block": steps,
             "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms}, "check": check,
             "tolerance": tolerance}
    if args.calls:
        entry.update(call_record(arms, batches))
    if args.cpu_time:
        entry["cpu_ns_per_step"] = cpu_blocks(arms, batches, reps, steps, before_block)
    result = {"threads": torch.get_num_threads(), "world_size": dist.get_world_size(), "device": str(device),
              "ranks_share_device_0": is_node(), "lite_core": str(Path(sys.modules["lite_core"].__file__).parent),
              "timer_floor_ns": timer_floor_ns(), "models": {"moe": entry}}
    if lite.is_global_zero:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
