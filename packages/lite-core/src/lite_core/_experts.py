"""Expert parallelism as a torch `ParallelStyle`: the stacked expert weights of a Mixture-of-Experts
layer are sharded along the expert dimension over one mesh dimension, and the tokens travel to the
process that holds their expert and back, through torch's autograd all-to-all.

Public as `lite_core.parallel.ExpertParallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lite_core.errors import ConfigurationError, MisuseError

__all__ = ["ExpertParallel", "check_experts_averaged", "check_experts_held", "count_loads_over", "expert_load",
           "load_counters"]


class ExpertParallel(ParallelStyle):
    """Shards a module of stacked experts over one mesh dimension and sends each token to the
    process that holds its expert: `parallelize_module(model.moe.experts, mesh["data_parallel"],
    ExpertParallel())`, as `ColwiseParallel` is applied to a linear layer.

    The experts module's contract, the same with and without this style:

    - every parameter is stacked, at least 2-D with the number of experts `E` first (e.g.
      `w1 [E, hidden, ffn]`, `w2 [E, ffn, hidden]`), and `E` divides evenly over the mesh dimension;
    - `forward(tokens, num_tokens_per_expert)` receives `tokens` `[T, hidden]` sorted by expert (all
      of expert 0's tokens, then expert 1's, ...) and `num_tokens_per_expert` `[E]` (integers
      summing to `T`), and returns `[T, out]` in the same order; inside, a loop over the experts or
      `torch._grouped_mm`, as the module likes;
    - or, as Hugging Face transformers 5.x's experts modules (Qwen3-MoE's, Mixtral's, ...) are
      called, `forward(hidden_states, top_k_index, top_k_weights)` with `hidden_states` `[T, hidden]`
      and the router's choices and weights `[T, k]`, returning the weighted sum `[T, hidden]`: the
      style sorts the (token, slot) pairs by expert, sends them, calls the module on this process's
      experts with each received token's local expert and a weight of 1 (its `num_experts`
      attribute, if any, says `E/n` meanwhile), and weighs and sums the results per token on the
      way back, so those models need no change.

    After the style, each of `n` processes holds experts `r*E/n ... (r+1)*E/n - 1` as `DTensor`s
    placed `Shard(0)`; the module's forward still receives plain tensors: its weights are this
    process's experts, `tokens` are those sent to them by every process of the dimension (sorted by
    local expert) and `num_tokens_per_expert` has `E/n` entries. The results go back to the process
    that sent each token, in its order, so the code around the experts (router, gather, weighted
    sum) is unchanged.

    Gradients: each process of the dimension is assumed to hold its own data and its loss to be a
    mean over it, the loss of one process over the whole batch being the mean of theirs; the style
    divides the experts' gradients by the dimension's size (see `_ScaledGradient`). Other weights are
    averaged over the data-parallel processes as usual (e.g. `fully_shard` with the experts'
    parameters in `ignored_params`).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ConfigurationError(
                f"ExpertParallel got a {device_mesh.ndim}-D mesh: pass the one dimension the experts are sharded"
                " over, e.g. parallelize_module(experts, device_mesh['data_parallel'], ExpertParallel())."
            )
        _check_stacked(module, device_mesh.size())
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        first = next(iter(module.parameters(recurse=False)))  # a DTensor: its shape is the whole one
        dispatch = _Dispatch(device_mesh, first.shape[0], first.to_local().device)
        setattr(module, _DISPATCH, dispatch)
        module.register_forward_pre_hook(dispatch.send)
        module.register_forward_hook(dispatch.receive, always_call=True)
        return module


def check_experts_held(model: nn.Module, strategy_name: str, holds: bool) -> None:
    """Refuse, in one sentence, a model given to `setup` with experts already under `ExpertParallel`
    when the strategy cannot hold them (`holds`: its `holds_expert_parallel`): each process keeps
    other experts, and a strategy that averages every gradient over its processes (`ddp`), or
    shards every parameter its own way, would silently mix them."""
    if holds:
        return
    for name, module in model.named_modules():
        if _DISPATCH in module.__dict__:
            raise ConfigurationError(
                f"strategy={strategy_name!r} cannot hold the experts of '{name or type(module).__name__}' under"
                " ExpertParallel, since each process keeps other experts and their gradients would be averaged"
                " together: use ModelParallelStrategy(parallelize_fn, mesh=MeshLayout(expert=...)) and apply"
                " ExpertParallel inside parallelize_fn."
            )


def check_experts_averaged(model: nn.Module, tokens: DeviceMesh) -> None:
    """Refuse, in one sentence, an experts module under `ExpertParallel` whose parameters do not
    span every process of `tokens` (those with tokens of their own: the strategy's
    `"data_parallel"`, or `"data_context_parallel"` under context parallelism): with
    `MeshLayout(shard=4, expert=2)` the experts sharded over `"expert_parallel"` alone get each
    expert-parallel group's gradient, and nothing averages it over the groups of
    `"expert_data_parallel"` (the step would silently follow part of the batch). `fully_shard` over
    `"expert_data_parallel"` puts them on both dimensions and averages them."""
    ranks: set[int] = set()
    for name, module in model.named_modules():
        if _DISPATCH not in module.__dict__:
            continue
        ranks = ranks or set(tokens.mesh.flatten().tolist())
        for param in module.parameters(recurse=False):
            spanned = set(param.device_mesh.mesh.flatten().tolist()) if isinstance(param, DTensor) else set()
            if ranks <= spanned:
                continue
            raise ConfigurationError(
                f"The experts of '{name or type(module).__name__}' are sharded over {len(spanned & ranks)} of the"
                f" {len(ranks)} data-parallel processes, so nothing averages their gradients over the others: in"
                " parallelize_fn also apply fully_shard(experts, mesh=device_mesh['expert_data_parallel']) after"
                " ExpertParallel, or shard them over device_mesh['data_parallel']."
            )


def count_loads_over(model: nn.Module, data_parallel: DeviceMesh) -> None:
    """Make `expert_load` of every experts module in `model` count the tokens of every process of
    `data_parallel` (the strategy's `"data_parallel"` dimension: every process with its own data),
    so that the statistic is the global batch's under every layout, not its expert-parallel group's."""
    for module in model.modules():
        dispatch = module.__dict__.get(_DISPATCH)
        if dispatch is not None:
            dispatch.data_parallel = data_parallel


def load_counters(model: nn.Module) -> list[torch.Tensor]:
    """The tensors in which the experts modules of `model` under `ExpertParallel` count their tokens
    (see `expert_load`), updated in place by each forward: a caller that runs a forward that must
    not count (torch's pipeline stages infer their shapes by running a part once) saves them before
    and puts them back after it, as it does with the buffers."""
    return [module.__dict__[_DISPATCH].counter for module in model.modules() if _DISPATCH in module.__dict__]


def _check_stacked(module: nn.Module, size: int) -> None:
    """Refuse an experts module whose parameters are not stacked `[num_experts, ...]` (at least 2-D,
    one first size) or whose number of experts the mesh dimension does not divide, in one sentence."""
    params = dict(module.named_parameters(recurse=False))
    counts = {name: (param.shape[0] if param.dim() else 0) for name, param in params.items()}
    stacked = all(param.dim() >= 2 for param in params.values())
    if not params or not stacked or len(set(counts.values())) != 1:
        found = ", ".join(f"{name} {list(param.shape)}" for name, param in params.items()) or "no parameters"
        raise ConfigurationError(
            f"ExpertParallel needs a module whose own parameters are stacked experts [num_experts, ...] of one"
            f" num_experts, but {type(module).__name__} holds {found}: apply it to the module that holds the"
            " stacked expert weights."
        )
    experts = next(iter(counts.values()))
    if experts % size:
        raise ConfigurationError(
            f"The mesh dimension of size {size} does not divide the {experts} experts of {type(module).__name__}:"
            " shard them over a dimension whose size divides the number of experts."
        )


@dataclass
class _Route:
    """One forward call's way back: the token counts sent to and received from each process, and
    the order that groups the received tokens by local expert."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor
    locals: dict[str, torch.Tensor]
    routed: _Routed | None = None


@dataclass
class _Routed:
    """A Hugging Face call `experts(hidden_states, top_k_index, top_k_weights)`, made into the sorted
    form: `pairs` sorts the (token, slot) pairs by expert; the results are weighted and summed per
    token on the way back, as the module itself would."""

    pairs: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor
    shape: torch.Size
    num_experts: Any


def expert_load(module: nn.Module) -> torch.Tensor:
    """The tokens each expert of `module` received over the global batch since the previous call
    (or since `ExpertParallel` was applied): `[num_experts]` integers, the same on every process.

    Under `ModelParallelStrategy` it counts every data-parallel process's tokens, whatever the
    layout (with `MeshLayout(shard=4, expert=2)` the two expert-parallel groups' together), so it
    does not depend on the layout; with `ExpertParallel` applied on a mesh of your own, the
    processes of the mesh dimension it shards over. A collective: call it on every process.

    Each forward call counts (a forward that activation checkpointing runs again counts twice).
    Log it, or its imbalance (`load.max() / load.float().mean()`), to see how the router spreads
    the tokens.

    Raises:
        MisuseError: `module` is not an experts module under `ExpertParallel`.
    """
    dispatch = module.__dict__.get(_DISPATCH)
    if dispatch is None:
        raise MisuseError(
            f"expert_load() takes an experts module under ExpertParallel, but {type(module).__name__} is not one:"
            " pass the module you applied parallelize_module(..., ExpertParallel()) to."
        )
    return dispatch.take_load()


#: The attribute under which an experts module keeps its `_Dispatch`.
_DISPATCH = "_lite_expert_dispatch"


class _Dispatch:
    """The forward hooks of one experts module: `send` before its forward, `receive` after it."""

    def __init__(self, mesh: DeviceMesh, experts: int, device: torch.device) -> None:
        self._mesh = mesh
        self._experts = experts  # the whole module's
        self._routes: list[_Route] = []
        #: Tokens this process's experts received from every process since `take_load`.
        self._load = torch.zeros(experts // mesh.size(), dtype=torch.int64, device=device)
        #: Every process with its own data, where a strategy said (`count_loads_over`): `take_load`
        #: then counts the global batch; otherwise the processes of `mesh`.
        self.data_parallel: DeviceMesh | None = None

    @property
    def counter(self) -> torch.Tensor:
        """The tokens counted since `take_load` (`load_counters`)."""
        return self._load

    @property
    def _counts_globally(self) -> bool:
        """Whether a strategy named more data-parallel processes than the mesh dimension holds
        (`count_loads_over`): the global batch then spans several expert-parallel groups."""
        return self.data_parallel is not None and self.data_parallel.size() > self._mesh.size()

    @property
    def batch_group(self) -> torch.distributed.ProcessGroup:
        """The processes that hold the global batch between them, each its own part: every
        data-parallel process where a strategy said (`count_loads_over`), else those of `mesh`."""
        if self._counts_globally:
            return self.data_parallel.get_group()
        return self._mesh.get_group()

    def take_load(self) -> torch.Tensor:
        """Every expert's tokens since the last call, gathered over the mesh dimension (see `expert_load`)."""
        local, self._load = self._load, torch.zeros_like(self._load)
        if self._counts_globally:
            # This process's experts' counts in their places; the other expert-parallel groups hold
            # the same experts for other data, so the sum over every data-parallel process is global.
            whole = torch.zeros(self._experts, dtype=local.dtype, device=local.device)
            start = self._mesh.get_local_rank() * local.numel()
            whole[start:start + local.numel()] = local
            torch.distributed.all_reduce(whole, group=self.data_parallel.get_group())
            return whole
        gathered = [torch.empty_like(local) for _ in range(self._mesh.size())]
        torch.distributed.all_gather(gathered, local, group=self._mesh.get_group())
        return torch.cat(gathered)

    def send(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        routed = None
        if _routed_call(args):
            tokens, counts, routed = _sorted_by_expert(module, self._experts, *args)
        else:
            tokens, counts = _tokens_and_counts(module, args)
        size = self._mesh.size()
        group = self._mesh.get_group()
        # counts[r, e]: tokens for the e-th expert of process r; this process gets row `rank` of everyone's.
        outgoing = counts.reshape(size, -1).to(torch.int64)
        incoming = torch.empty_like(outgoing)
        torch.distributed.all_to_all_single(incoming, outgoing, group=group)
        sent, received = outgoing.sum(1).tolist(), incoming.sum(1).tolist()
        arrived = _ScaledGradient.apply(all_to_all_single_autograd(tokens, received, sent, group), size)
        order = _by_local_expert(incoming)
        per_local_expert = incoming.sum(0)
        self._load += per_local_expert.to(self._load.device)
        self._routes.append(_Route(sent, received, order, _present_local_weights(module), routed))
        local_counts = per_local_expert.to(counts.dtype)
        if routed is None:
            return arrived[order], local_counts
        # The module's own routed forward, over this process's experts: each arrived token with its
        # local expert and a weight of 1 (the weights are applied on the way back).
        experts = torch.repeat_interleave(torch.arange(len(local_counts), device=tokens.device), local_counts)
        if routed.num_experts is not None:
            module.num_experts = len(local_counts)
        ones = torch.ones(len(experts), 1, dtype=routed.weights.dtype, device=tokens.device)
        return arrived[order], experts.unsqueeze(1), ones

    def receive(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self._routes:
            return output  # `send` refused the call; its error follows
        route = self._routes.pop()
        for name in route.locals:
            module.__dict__.pop(name, None)
        if route.routed is not None and route.routed.num_experts is not None:
            module.num_experts = route.routed.num_experts
        if not isinstance(output, torch.Tensor):
            return output  # the forward failed (always_call); its error follows
        size = self._mesh.size()
        # Back in arrival order (the received tokens were `arrived[order]`), then to the process that
        # sent each token, in the order it sent them.
        arrival = torch.empty_like(output).index_copy(0, route.order, _ScaledGradient.apply(output, 1 / size))
        results = all_to_all_single_autograd(arrival, route.sent, route.received, self._mesh.get_group())
        return results if route.routed is None else _combined(results, route.routed)


def _tokens_and_counts(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(args) != 2 or not all(isinstance(arg, torch.Tensor) for arg in args):
        raise MisuseError(
            f"{type(module).__name__} under ExpertParallel got {len(args)} positional argument(s), not the two tensors"
            " of experts(tokens, num_tokens_per_expert) nor the three of Hugging Face's experts(hidden_states,"
            " top_k_index, top_k_weights): pass the tokens sorted by expert and their count per expert."
        )
    return args[0], args[1]


def _routed_call(args: tuple[Any, ...]) -> bool:
    """Whether the call is Hugging Face's `experts(hidden_states, top_k_index, top_k_weights)`."""
    return (len(args) == 3 and all(isinstance(arg, torch.Tensor) for arg in args) and args[1].dim() == 2
            and not args[1].is_floating_point() and args[2].shape == args[1].shape)


def _sorted_by_expert(module: nn.Module, experts: int, hidden: torch.Tensor, index: torch.Tensor,
                      weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Routed]:
    """A routed call's (token, slot) pairs sorted by expert: their tokens, the count for each of the
    module's `experts`, and what `_combined` needs to weigh and sum the results per token."""
    flat = index.reshape(-1)
    pairs = torch.argsort(flat, stable=True)
    tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(index.shape[1])
    routed = _Routed(pairs, tokens, weights, hidden.shape, getattr(module, "num_experts", None))
    return hidden[tokens[pairs]], torch.bincount(flat, minlength=experts), routed


def _combined(results: torch.Tensor, routed: _Routed) -> torch.Tensor:
    """Each token's results weighted by its router weights and summed, as the module's own loop does."""
    per_pair = torch.empty_like(results).index_copy(0, routed.pairs, results)
    weighted = per_pair * routed.weights.reshape(-1, 1)
    return torch.zeros(routed.shape, dtype=results.dtype, device=results.device).index_add(0, routed.tokens, weighted)


def _by_local_expert(incoming: torch.Tensor) -> torch.Tensor:
    """The order that sorts tokens received as (process, local expert) chunks by (local expert, process)."""
    sources, experts = incoming.shape
    chunk = torch.arange(sources * experts, device=incoming.device)
    key = (chunk % experts) * sources + chunk // experts
    return torch.argsort(torch.repeat_interleave(key, incoming.flatten()), stable=True)


def _present_local_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Show the module's forward this process's experts as plain tensors (an instance attribute
    hides the parameter until `receive` removes it); their gradients flow back into the `DTensor`s."""
    locals_ = {name: param.to_local() for name, param in module.named_parameters(recurse=False)
               if isinstance(param, DTensor)}
    module.__dict__.update(locals_)
    return locals_


class _ScaledGradient(torch.autograd.Function):
    """The identity forward, whose backward multiplies the gradient by `scale`.

    Why: with `n` processes each averaging the loss over its own tokens, one process over the whole
    batch minimises L = (L_0 + ... + L_{n-1}) / n. An expert here receives tokens from every
    process, and the all-to-all's backward brings each process's gradient of its own L_r back, so
    the expert's gradient would be sum_r dL_r/dw = n * dL/dw. The experts' results scale their
    gradient by 1/n on the way back and the tokens they received by n, so the experts' weights get
    dL/dw and each sender's tokens their own dL_r/dx. Weights that are not experts see only their
    own process's tokens, dL_r/dw, and data parallelism averages them over the n processes:
    (1/n) sum_r dL_r/dw = dL/dw, the same scale. Scaling the tokens' gradients costs tokens x hidden
    elements, where dividing the experts' gradients would cost their whole size, and with a
    power-of-two `n` both scalings are exact.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None
