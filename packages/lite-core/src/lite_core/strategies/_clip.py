"""One global gradient norm over parameters that live on different device meshes.

Under tensor parallelism combined with `fully_shard`, the parallelised parameters are DTensors on
the 2-D mesh and the others on its 1-D data-parallel submesh, so `torch.nn.utils.clip_grad_norm_`
cannot stack their norms ("All operands in aten.stack.default must have the same mesh"). Here the
gradients are grouped by mesh and placements; torch's `get_total_norm` computes each group's norm
(a DTensor, made whole with `full_tensor()`: the collective over exactly that group's mesh), and
the groups' norms combine into one as the norms of parts of one vector do. Every rank holds the
same parameters in the same order, so every rank runs the same collectives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

#: torch's logger that notes, once per call, that making a norm whole over a 2-D mesh takes "2
#: sequential all_reduce operations" (one per mesh dimension) where one would do. The norm is one
#: scalar per group, so the second collective costs nothing worth a line per rank per step, and the
#: choice of collective is Lite's, not the user's: `_quiet_redistribute` drops that note only.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def _not_the_sequential_collectives_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("While redistributing from")


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    logger.addFilter(_not_the_sequential_collectives_note)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_sequential_collectives_note)


def _group_key(grad: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    return (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The `norm_type`-norm of all `grads` together, as a plain tensor equal on every rank."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(_group_key(grad), []).append(grad)
    norms = []
    for group in groups.values():
        with _quiet_redistribute():  # get_total_norm stacks the group's norms: the redistribution is there
            norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    stacked = torch.stack([n.to(device, torch.float32) for n in norms])
    return torch.linalg.vector_norm(stacked, ord=norm_type)


def combine_over(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm of the parts of one vector that the processes of `group` hold, from each one's
    `norm` of its part (pipeline stages hold different parameters)."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.float() ** norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, across: Any = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on any mesh and placements (and plain
    tensors); returns the total norm as a plain tensor. With `across` (a process group whose
    processes hold different parameters, e.g. pipeline stages), the norm is over all of theirs."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, float(norm_type))
    if across is not None:
        norm = combine_over(norm.clone(), float(norm_type), across)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped:"
            " lower the learning rate or pass error_if_nonfinite=False."
        )
    coefficient = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))  # one host sync, not one per gradient
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coefficient)
    return norm
