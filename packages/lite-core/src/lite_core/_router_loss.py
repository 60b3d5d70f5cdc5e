"""A Mixture-of-Experts router's load-balancing loss over the global batch, whichever processes
hold its parts. Public as `lite_core.parallel.load_balancing_loss`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from lite_core._experts import _DISPATCH

__all__ = ["load_balancing_loss"]


def load_balancing_loss(router_probs: torch.Tensor, top_k_index: torch.Tensor,
                        experts: nn.Module | None = None) -> torch.Tensor:
    """The auxiliary load-balancing loss of a router over the **global batch**: `E * sum_e f_e * P_e`,
    with `f_e` the share of tokens whose top-k includes expert `e` (counted over the `k` slots, as
    transformers' `load_balancing_loss_func` counts them, so that one plain process gets the value it
    gets) and `P_e` the mean router probability of expert `e`, both over every process's tokens.

    Each process computes the same value; its gradient reaches this process's router through its own
    tokens' probabilities, so that after the data-parallel average of the router's gradients the
    step is that of one process over the whole batch, whatever the layout. A collective: call it on
    every process that holds part of the batch.

    Args:
        router_probs: `[T, E]` this process's tokens' router probabilities over all `E` experts
            (the softmax of the router's logits; several layers' rows may be stacked).
        top_k_index: `[T, k]` the experts each token was sent to.
        experts: the experts module under `ExpertParallel` whose tokens these are: the processes
            that hold the batch are those it counts its load over (see `expert_load`). Without it,
            the default process group's (one process, `ddp`, `fsdp`: every process its own data);
            alone in a process, the batch is this process's.

    Example:
        >>> probs = torch.softmax(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), dim=-1)
        >>> load_balancing_loss(probs, probs.topk(1, dim=-1).indices)
        tensor(1.0000)
    """
    num_experts = router_probs.shape[-1]
    chosen = torch.nn.functional.one_hot(top_k_index.reshape(len(top_k_index), -1), num_experts)
    counts = torch.cat([chosen.sum((0, 1)), torch.tensor([len(router_probs)])]).to(router_probs)
    probs = router_probs.sum(0)
    group = _batch_group(experts)
    if group is not None:
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=group)
        probs = differentiable_all_reduce(probs, group=group)
    tokens = counts[-1]
    return num_experts * ((counts[:-1] / tokens) * (probs / tokens)).sum()


def _batch_group(experts: nn.Module | None) -> dist.ProcessGroup | None:
    dispatch = experts.__dict__.get(_DISPATCH) if experts is not None else None
    if dispatch is not None:
        return dispatch.batch_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None
