"""Initialising a model whose parameters were built on the meta device, after it has been sharded.

Inside `init_module(empty_init=True)` each parameter moves to the meta device as it is
registered, while buffers are computed on the device as usual (a causal mask or a constant
written in `__init__` has no `reset_parameters()` that could recreate it). After sharding, each
module's `reset_parameters()` is replayed in the order a normal build runs them, from the random
state captured when the context was entered, on full-size temporaries of that module's own
parameters only; each process keeps its shard. So the weights equal a normal build's for the
same seed, and no more than one module's parameters exist whole at once. A module without
`reset_parameters()` is initialised by the root module's `_init_weights(module)` where the root
has one, as `transformers` models initialise each of their modules (their norms have no
`reset_parameters()`); such a model is usually built this way to load its weights afterwards
(`LightningLite.load_safetensors`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from lite_core.errors import MisuseError


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside this context every parameter a module registers is replaced by a meta one.

    The hook is global to `nn.Module` (as torch's device contexts are to factory functions), so
    modules built on another thread meanwhile are affected too.
    """
    handle = register_module_parameter_registration_hook(_to_meta)
    try:
        yield
    finally:
        handle.remove()


def _to_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
    if param.is_meta or isinstance(param, nn.parameter.UninitializedParameter):
        return None
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


def _own_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def check_reinitialisable(module: nn.Module) -> None:
    """Refuse a meta-built module with parameters that nothing could recreate (`_initialiser`)."""
    for name, submodule in module.named_modules():
        if _own_parameters(submodule) and _initialiser(module, submodule) is None:
            raise MisuseError(
                f"The module '{name or type(submodule).__name__}' ({type(submodule).__name__}) holds"
                " parameters but has no reset_parameters(), so init_module(empty_init=True)"
                " cannot initialise it after sharding: give it a reset_parameters() method or build"
                " the model with empty_init=False."
            )


def _initialiser(root: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    """What recreates `module`'s own parameters: its `reset_parameters()`, else the root's
    `_init_weights(module)` (the `transformers` convention), else nothing."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    init_weights = getattr(root, "_init_weights", None)
    return functools.partial(init_weights, module) if callable(init_weights) else None


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
    _parameters_to_empty(module, shard_device)
    on_device = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if on_device else [], device_type=device.type):
        if rng_state is not None:
            torch.set_rng_state(rng_state[0])
            if on_device and rng_state[1] is not None:
                torch.get_device_module(device).set_rng_state(rng_state[1], device)
        for submodule in module.modules():
            initialiser = _initialiser(module, submodule)
            if _own_parameters(submodule) and initialiser is not None:
                _reset_one(submodule, initialiser, device)


def _parameters_to_empty(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` for the meta tensors only: computed buffers keep their values."""
    computed = [(owner, name, buffer) for owner in module.modules()
                for name, buffer in owner._buffers.items() if buffer is not None and not buffer.is_meta]
    module.to_empty(device=device)
    for owner, name, buffer in computed:
        owner._buffers[name] = buffer


def _reset_one(module: nn.Module, initialiser: Callable[[], None], device: torch.device) -> None:
    """`initialiser()` (`module.reset_parameters()`, say) on full-size stand-ins for its sharded parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    full = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            for n, p in sharded.items()}
    try:
        for name, stand_in in full.items():
            module._parameters[name] = stand_in
        with torch.no_grad():
            initialiser()
    finally:
        for name, param in sharded.items():
            module._parameters[name] = param
    with torch.no_grad():
        for name, param in sharded.items():
            # Every process computed the same full tensor: keep this process's chunk, no traffic.
            shard = distribute_tensor(full[name].detach(), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
