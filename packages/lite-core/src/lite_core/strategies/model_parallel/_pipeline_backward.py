"""`backward(f(loss))` under pipeline parallelism, as the user wrote it: scaled losses and
gradients accumulated over several steps.

The schedule's step runs forward and backward together, inside `model(x, target=y)`, and ends by
dividing *every* gradient its stage holds by the number of micro-batches (FSDP adds into what is
there). So the step runs with the gradients set aside: what it computes is kept apart with the
loss it belongs to (a leaf that wants a gradient), and `backward(tensor)` adds it into `.grad`
times the derivative of `tensor` with respect to that loss (the chain rule: `loss / n` adds `1/n`
of it). Gradients therefore appear at `backward` and accumulate across steps as under one process,
`no_backward_sync` needs nothing more, and the gradients of a loss that is never passed to
`backward` are dropped with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lite_core.errors import MisuseError

Gradients = list[tuple[nn.Parameter, "torch.Tensor | None"]]


def run_apart(parameters: Iterable[nn.Parameter], step: Callable[[], None]) -> Gradients:
    """Run `step` with every parameter's gradient set aside; the gradients it computed, each
    parameter's `.grad` as it was before."""
    earlier = [(parameter, parameter.grad) for parameter in parameters]
    for parameter, _ in earlier:
        parameter.grad = None
    try:
        step()
        return [(parameter, parameter.grad) for parameter, _ in earlier]
    finally:
        for parameter, grad in earlier:
            parameter.grad = grad


@dataclass
class StepGradients:
    """The gradients of one training call, waiting for `backward` of (a function of) its loss."""

    loss: weakref.ref[torch.Tensor]
    gradients: Gradients

    def add_into_grad(self, scale: float) -> None:
        """`.grad += scale * gradient` for each parameter (`.grad` is the gradient where it was `None`)."""
        for parameter, gradient in self.gradients:
            if gradient is None:
                continue
            if scale != 1.0:
                gradient.mul_(scale)
            if parameter.grad is None:
                parameter.grad = gradient
            else:
                parameter.grad.add_(gradient)
        self.gradients = []


def leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that want a gradient which `tensor` was computed from (its graph's leaves)."""
    if tensor.grad_fn is None:
        return [tensor] if tensor.requires_grad else []
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            found.append(variable)
        else:
            stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def scales(tensor: torch.Tensor, losses: list[torch.Tensor]) -> list[float]:
    """The derivative of `tensor` with respect to each of `losses` (the pipeline losses it was
    computed from); refuses a tensor computed from anything else that wants a gradient."""
    if len(losses) == 1 and tensor is losses[0]:
        return [1.0]
    pending = {id(loss) for loss in losses}
    others = [leaf for leaf in leaves(tensor) if id(leaf) not in pending]
    if others or tensor.numel() != 1:
        raise MisuseError(
            "Under pipeline parallelism backward() takes a scalar computed from the losses model(x, target=y)"
            " returned (such as loss / n), because the schedule already ran the model's backward pass: compute"
            " any other term of the loss inside loss_fn."
        )
    derivatives = torch.autograd.grad(tensor, losses)
    return [float(derivative) for derivative in derivatives]


def backward(pipelines: Iterable[Any], tensor: torch.Tensor, replicas: Any = None) -> bool:
    """`backward(tensor)` for a tensor computed from the losses that `pipelines` (`PipelineForward`s)
    returned: each loss's step gradients added into `.grad`, scaled by the derivative of `tensor`
    with respect to it. Whether `tensor` was such a tensor (if not, nothing was done).

    Args:
        pipelines: the strategy's pipelines.
        tensor: what the user passed to `backward`.
        replicas: the data-parallel process group when it has several processes: the gradients
            were averaged over it, so the scales must agree on it (checked, one collective).
    """
    waiting = [(loss, pipeline, step) for pipeline in pipelines for loss, step in pipeline.waiting()]
    found = {id(leaf) for leaf in leaves(tensor)}
    used = [entry for entry in waiting if id(entry[0]) in found]
    if not used:
        return False
    factors = scales(tensor, [loss for loss, _, _ in used])
    if replicas is not None:
        _check_same_on_replicas(factors, replicas, used[0][0].device)
    for factor, (_, pipeline, step) in zip(factors, used):
        step.add_into_grad(factor)
        pipeline.taken(step)
    return True


def _check_same_on_replicas(factors: list[float], group: Any, device: torch.device) -> None:
    """Refuse, on every data-parallel rank alike, scales that differ between them: the step's
    gradients are already the average over them, which one factor per rank cannot undo."""
    import torch.distributed as dist

    seen = torch.tensor([*factors, *(-f for f in factors)], dtype=torch.float64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = seen[:len(factors)].tolist(), [-v for v in seen[len(factors):].tolist()]
    if highest != lowest:
        raise MisuseError(
            f"backward() scaled the pipeline's loss by factors that differ between data-parallel ranks"
            f" ({min(lowest)} to {max(highest)}), which the gradients, already averaged over them, cannot"
            " follow: scale the loss by the same factor on every rank (such as loss / n)."
        )
