"""Initialising a model that was built on the meta device, after it has been sharded.

Each module's `reset_parameters()` is replayed in the order a normal build runs them, from the
random state captured when `init_module(empty_init=True)` was entered, on full-size temporaries
of that module's own parameters only; each process keeps its shard. So the weights equal a
normal build's for the same seed, and no more than one module's parameters exist whole at once.
"""

from __future__ import annotations

import torch
from torch import nn

from lite_core.errors import MisuseError


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def check_reinitialisable(module: nn.Module) -> None:
    """Refuse a meta-built module with state that no `reset_parameters()` could recreate."""
    for name, submodule in module.named_modules():
        if _own_tensors(submodule) and not callable(getattr(submodule, "reset_parameters", None)):
            raise MisuseError(
                f"The module '{name or type(submodule).__name__}' ({type(submodule).__name__}) holds"
                " parameters or buffers but has no reset_parameters(), so init_module(empty_init=True)"
                " cannot initialise it after sharding: give it a reset_parameters() method or build"
                " the model with empty_init=False."
            )


def capture_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a normal build on `device` would start from (CPU, and the device's own)."""
    if device.type == "cpu":
        return torch.get_rng_state(), None
    return torch.get_rng_state(), torch.get_device_module(device).get_rng_state(device)


def materialise(module: nn.Module, shard_device: torch.device, device: torch.device,
                rng_state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    """Allocate the shards of a sharded meta-built `module` on `shard_device` and initialise them
    as a normal build on `device` would, drawing from `rng_state` (from `capture_rng`) without
    changing this process's random state."""
    module.to_empty(device=shard_device)
    on_device = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if on_device else [], device_type=device.type):
        if rng_state is not None:
            torch.set_rng_state(rng_state[0])
            if on_device and rng_state[1] is not None:
                torch.get_device_module(device).set_rng_state(rng_state[1], device)
        for submodule in module.modules():
            if _own_tensors(submodule):
                _reset_one(submodule, device)


def _reset_one(module: nn.Module, device: torch.device) -> None:
    """`module.reset_parameters()` on full-size stand-ins for its sharded parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    full = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            for n, p in sharded.items()}
    try:
        for name, stand_in in full.items():
            module._parameters[name] = stand_in
        with torch.no_grad():
            module.reset_parameters()  # type: ignore[operator]
    finally:
        for name, param in sharded.items():
            module._parameters[name] = param
    with torch.no_grad():
        for name, param in sharded.items():
            # Every process computed the same full tensor: keep this process's chunk, no traffic.
            shard = distribute_tensor(full[name].detach(), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
