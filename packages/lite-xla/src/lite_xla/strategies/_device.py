"""What every XLA strategy does with the device: loaders, batches, graph cuts, CPU copies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from lite_core.plugins import move_to_device


def device_loader(dataloader: Iterable[Any], device: torch.device) -> Iterable[Any]:
    """torch-xla's parallel loader: batches are moved to `device` in the background, and the
    graph is cut between batches."""
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    return MpDeviceLoader(dataloader, device)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of `batch` that are not yet on an XLA device (the loader moved the rest),
    wherever they sit: the core's walk (dataclasses and `.to()` objects too, which torch-xla's
    loader leaves on the CPU), each tensor entering the graph as data."""
    return move_to_device(batch, device, lambda t: t if t.device.type == "xla" else as_data(t, device).reshape(t.shape))


def as_data(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, entering the graph as data.

    torch-xla (2.9.0) bakes a one-element CPU tensor moved to the device into the graph as a
    constant: each new value compiles a new graph, and where values differ between replicas (a
    rank, a per-replica metric) each replica compiles its own. Such a tensor travels as two
    elements (the graph takes the first), so the graph is the same whatever the value; a 0-dim
    tensor comes back with shape `(1,)`.
    """
    if tensor.device.type == "xla" or tensor.numel() != 1:
        return tensor.to(device)
    flat = tensor.reshape(1)
    return torch.cat([flat, flat]).to(device)[:1]


def cut_graph() -> None:
    """Compile and run the operations recorded so far, so each step is one graph."""
    import torch_xla

    torch_xla.sync()


def to_cpu(state: Any) -> Any:
    """`state` with every tensor copied to the CPU (what `save` writes)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state)


def relink(optimizer: Any, moved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point `optimizer` (its groups and its state) at the moved parameters, in place."""
    if not moved:
        return
    for group in optimizer.param_groups:
        group["params"] = [moved[id(p)][1] if id(p) in moved else p for p in group["params"]]
    for key in [k for k in optimizer.state if id(k) in moved]:
        optimizer.state[moved[id(key)][1]] = _device_state(optimizer.state.pop(key), moved[id(key)][1])


def _device_state(state: Any, param: torch.Tensor) -> Any:
    # Scalars such as Adam's `step` stay where the optimizer keeps them (on the CPU).
    return tree_map_only(torch.Tensor, lambda t: t.to(param.device) if t.dim() > 0 else t, state)
