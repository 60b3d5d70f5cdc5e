"""Expert parallelism (`lite_core.parallel.ExpertParallel`) on 2 processes: a hand-written tiny
Mixture-of-Experts (router, top-2 softmax routing, stacked experts run by a per-expert loop, no
capacity factor so no token is dropped), its 4 experts sharded over `ModelParallelStrategy`'s
data-parallel dimension (EP 2), each process training on its own half of every global batch with
an ordinary AdamW loop. Three times: the experts sharded over the data-parallel dimension
itself, over the `"expert_parallel"` dimension of `MeshLayout(shard=2, expert=2)`, and the latter
with the router's load-balancing loss over the global batch (`load_balancing_loss`) added to each
step's loss. Then a tiny
Hugging Face MoE of each family in `HF_FAMILIES` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
DeepSeek-V3, gpt-oss; transformers' code unchanged) with every layer's experts under EP 2.

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
from lite_core.parallel import ExpertParallel, MeshLayout, expert_load, load_balancing_loss
from lite_core.strategies import ModelParallelStrategy

torch.set_num_threads(1)

WORLD = 2
GLOBAL_BATCH = 16
STEPS = 4
LR = 0.05
BALANCE = 0.5  # the router's load-balancing loss's weight, where a way adds it
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
        probs = torch.softmax(self.router(h), dim=-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        self.routing = (probs, chosen)  # for the router's load-balancing loss, if the loop adds one
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


def plain_pytorch(initial: dict[str, torch.Tensor], balance: float = 0.0) -> dict:
    """One plain process over the whole global batches: the reference (with `balance` times the
    router's load-balancing loss added, as `train` adds it)."""
    model = make_model()
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data()
    losses, gradients, loads = [], {}, []
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        with torch.no_grad():  # the router's choices over the whole batch: the load one process sees
            chosen = torch.softmax(model.router(model.embed(x[batch])), dim=-1).topk(TOP_K, dim=-1).indices
        loads.append(torch.bincount(chosen.flatten(), minlength=EXPERTS))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        if balance:
            loss = loss + balance * load_balancing_loss(*model.routing)
        loss.backward()
        gradients = gradients or full_gradients(model)
        optimizer.step()
        losses.append(loss.item())
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "gradients": gradients, "loads": torch.stack(loads)}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (AdamW hides a gradient's scale, this does not)."""
    return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for k, p in model.named_parameters()}


def train(lite: LightningLite, balance: float = 0.0) -> dict:
    """The user's loop on this process's half of every global batch (with `balance` times the
    router's load-balancing loss over the global batch added to each step's loss)."""
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = lite.setup(model, optimizer)
    x, y = make_data()
    half = GLOBAL_BATCH // WORLD
    rank = lite.strategy.device_mesh["data_parallel"].get_local_rank()
    losses, gradients, loads = [], {}, []
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + rank * half
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[start:start + half]), y[start:start + half])
        if balance:
            loss = loss + balance * load_balancing_loss(*model.routing, model.experts)
        lite.backward(loss)
        gradients = gradients or full_gradients(model)
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
        loads.append(expert_load(model.experts))  # this step's tokens per expert, over both processes
    return {"initial": initial, "final": full_weights(model), "losses": losses, "gradients": gradients,
            "dim_names": list(lite.strategy.device_mesh.mesh_dim_names), "loads": torch.stack(loads)}


class GroupedExperts(nn.Module):
    """The same contract computed by `torch._grouped_mm` (bfloat16 on CPU)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, width, width, dtype=torch.bfloat16) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, width, width, dtype=torch.bfloat16) / width**0.5)

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
        return torch._grouped_mm(torch.tanh(torch._grouped_mm(tokens, self.w1, offs=offsets)), self.w2, offs=offsets)


def grouped(lite: LightningLite, wrapped: bool = False) -> dict[str, torch.Tensor]:
    """`GroupedExperts` under EP 2 against the whole module on this process: output and token gradients.

    `wrapped`: both modules' parameters in torchao's FP8 MoE training wrappers first, as
    `Float8Precision(experts="rowwise")` converts them (its kernel, which needs a Hopper GPU,
    replaced by a stand-in that records the type of weight it is given): the shards `ExpertParallel`
    makes stay wrappers and the products under EP still reach the kernel."""
    torch.manual_seed(1)
    whole, sharded = GroupedExperts(), GroupedExperts()
    sharded.load_state_dict(whole.state_dict())
    kernel_calls: list[str] = []
    if wrapped:
        _wrap_experts_for_fp8((whole, sharded), kernel_calls)
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
        results[f"{name}_kernel_calls"], kernel_calls[:] = list(kernel_calls), []
    if wrapped:
        results["local_type"] = type(sharded.w1.to_local()).__name__
    return results


def _wrap_experts_for_fp8(modules: tuple[nn.Module, ...], kernel_calls: list[str]) -> None:
    import torchao.prototype.moe_training.tensor as wrappers
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    from lite_core.precision.fp8 import holds_stacked_experts

    def stand_in(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, config, bias=None) -> torch.Tensor:
        kernel_calls.append(type(B_t).__name__)
        return torch._grouped_mm(A.to(torch.bfloat16), B_t.to(torch.bfloat16), offs=offs)

    wrappers._quantize_then_scaled_grouped_mm = stand_in
    for module in modules:
        quantize_(module, Float8TrainingOpConfig(), filter_fn=holds_stacked_experts)


class _ThreeExperts(Experts):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(3, HIDDEN, FFN))
        self.w2 = nn.Parameter(torch.zeros(3, FFN, HIDDEN))


def _experts_sharded_over(model: MoE, mesh) -> MoE:
    parallelize_module(model.experts, mesh, ExpertParallel())
    return model


def refusals(lite: LightningLite) -> dict[str, str]:
    """What `ExpertParallel` refuses, by case: its message."""
    dp = lite.strategy.device_mesh["data_parallel"]
    under_ddp = LightningLite(accelerator="cpu", strategy="ddp", devices=WORLD)
    under_ddp.launch()  # the processes are started: it joins them
    cases = {
        "uneven": lambda: parallelize_module(_ThreeExperts(), dp, ExpertParallel()),
        "not_stacked": lambda: parallelize_module(nn.Linear(HIDDEN, HIDDEN), dp, ExpertParallel()),
        "two_dims": lambda: parallelize_module(Experts(), lite.strategy.device_mesh, ExpertParallel()),
        "call": lambda: parallelize_module(Experts(), dp, ExpertParallel())(torch.zeros(2, HIDDEN)),
        "load_of_plain": lambda: expert_load(Experts()),
        "ddp": lambda: under_ddp.setup(_experts_sharded_over(make_model(), dp)),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except LiteError as error:
            messages[name] = str(error)
    return messages


QWEN_STEPS, QWEN_BATCH, QWEN_VOCAB, QWEN_SEQUENCE = 3, 8, 32, 6

#: Tiny Hugging Face MoE families whose experts module keeps transformers 5.x's stacked layout
#: (`gate_up_proj [E, 2*ffn, hidden]`, `down_proj [E, hidden, ffn]`, called
#: `experts(hidden_states, top_k_index, top_k_weights)`): per family, its config and model classes
#: and what differs from the shared sizes (2 layers of 4 experts, top 2). Each has its own router:
#: Qwen3-MoE's and OLMoE's softmax top-k, Mixtral's, Qwen2-MoE's beside a gated shared expert,
#: DeepSeek-V3's sigmoid scores with a correction bias and a shared expert, gpt-oss's (whose experts
#: also hold stacked biases `[E, ...]` and a clamped SwiGLU).
HF_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=32, moe_intermediate_size=8, head_dim=8, num_experts=EXPERTS,
                       decoder_sparse_step=1, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=8, head_dim=8, num_local_experts=EXPERTS)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=8, num_experts=EXPERTS, eos_token_id=QWEN_VOCAB - 1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                       num_experts=EXPERTS, decoder_sparse_step=1)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=EXPERTS, n_group=1,
                         topk_group=1, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=None,
                         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=8, head_dim=8, num_local_experts=EXPERTS, sliding_window=4)),
}


def hf_model_class(family: str) -> type:
    import transformers

    return getattr(transformers, HF_FAMILIES[family][1])


def make_hf_moe(family: str = "qwen3_moe") -> nn.Module:
    """A tiny Hugging Face MoE of `family` from a config (no download), transformers' own code
    unchanged."""
    import transformers

    config_class, _, sizes = HF_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{
        "vocab_size": QWEN_VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 16, "num_experts_per_tok": TOP_K, **sizes})
    return hf_model_class(family)(config)


def qwen_tokens() -> torch.Tensor:
    return torch.randint(QWEN_VOCAB, (QWEN_STEPS * QWEN_BATCH, QWEN_SEQUENCE), generator=torch.Generator().manual_seed(3))


def qwen_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum, not AdamW: AdamW's first steps divide a gradient by its own magnitude, so a
    # last-bit difference in a near-zero gradient (two processes sum in another order) moves a
    # weight by about 1e-6 (measured: 1.7e-6 after 3 steps), and 1e-6 would then guard nothing.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def parallelize_hf_moe(model: nn.Module, device_mesh) -> nn.Module:
    """Every layer's `mlp.experts` (transformers' module, as it is) over the data-parallel dimension."""
    dp = device_mesh["data_parallel"]
    experts = [layer.mlp.experts for layer in model.model.layers]
    for module in experts:
        parallelize_module(module, dp, ExpertParallel())
    return fully_shard(model, mesh=dp, ignored_params={p for module in experts for p in module.parameters()})


def plain_hf_moe(initial: dict[str, torch.Tensor], family: str = "qwen3_moe") -> dict:
    """One plain process over the whole batches: the reference for `hf_moe`."""
    model = make_hf_moe(family)
    model.load_state_dict(initial)
    optimizer = qwen_optimizer(model)
    tokens, losses = qwen_tokens(), []
    for step in range(QWEN_STEPS):
        batch = tokens[step * QWEN_BATCH:(step + 1) * QWEN_BATCH]
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def hf_moe(lite: LightningLite, out: Path, family: str) -> dict:
    """The user's loop over a Hugging Face MoE of `family`, this process on its half of every batch;
    then its checkpoint (`OUT/FAMILY_ep2`) and its Hugging Face export (`OUT/FAMILY_hf`, with the
    config)."""
    model = make_hf_moe(family)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = qwen_optimizer(model)
    model, optimizer = lite.setup(model, optimizer)
    tokens, half, losses = qwen_tokens(), QWEN_BATCH // WORLD, []
    rank = lite.strategy.device_mesh["data_parallel"].get_local_rank()
    for step in range(QWEN_STEPS):
        batch = tokens[step * QWEN_BATCH + rank * half:step * QWEN_BATCH + (rank + 1) * half]
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        lite.backward(loss)
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
    local = model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape
    lite.save({"model": model, "optimizer": optimizer}, out / f"{family}_ep2")
    lite.export_safetensors(model, out / f"{family}_hf")
    if lite.is_global_zero:
        model.config.save_pretrained(out / f"{family}_hf")
    return {"initial": initial, "final": full_weights(model), "losses": losses, "local_experts": local[0],
            "checkpoint": str(out / f"{family}_ep2"), "export": str(out / f"{family}_hf")}


def launched(strategy: ModelParallelStrategy) -> LightningLite:
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=WORLD)
    lite.launch()
    return lite


def main(out: Path) -> None:
    lite = launched(ModelParallelStrategy(parallelize, data_parallel_size=WORLD, tensor_parallel_size=1))
    results = {"data_parallel": train(lite), "refusals": refusals(lite), "grouped": grouped(lite),
               "grouped_fp8": grouped(lite, wrapped=True)}
    lite = launched(ModelParallelStrategy(parallelize_on_the_expert_dimension,
                                          mesh=MeshLayout(shard=WORLD, tensor=1, expert=WORLD)))
    results["expert_parallel"] = train(lite)
    lite = launched(ModelParallelStrategy(parallelize_on_the_expert_dimension,
                                          mesh=MeshLayout(shard=WORLD, tensor=1, expert=WORLD)))
    results["balanced"] = train(lite, balance=BALANCE)
    for family in HF_FAMILIES:
        lite = launched(ModelParallelStrategy(parallelize_hf_moe, data_parallel_size=WORLD, tensor_parallel_size=1))
        results[family] = hf_moe(lite, out, family)
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
