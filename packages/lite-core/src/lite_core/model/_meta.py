"""A copy of a module on the meta device: its structure and the user's forward, without memory.

`measure_flops` counts on it, and a pipeline keeps one of the whole model from before the cut
(a process then holds only its stages' layers).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lite_core.model._module import STATE_KEY, user_class_of


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers are empty meta tensors of their full
    (unsharded) shape, and whose modules are of the user's own classes.

    A module that `setup()` or a sharding strategy changed (`fully_shard` makes it an `FSDP<Class>`
    that refuses `copy.deepcopy`) is rebuilt as a plain instance of the user's class, without the
    strategy's state and hooks: the count runs the user's forward on the whole model, as one
    process computes it."""
    memo: dict[int, Any] = {}
    for submodule in module.modules():
        for tensor in [*submodule._parameters.values(), *submodule._buffers.values()]:
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = _meta_tensor(tensor)
    changed = [m for m in module.modules() if user_class_of(m) is not type(m)]
    for submodule in changed:  # every shell first, so that references between modules resolve to them
        memo[id(submodule)] = object.__new__(user_class_of(submodule))
    for submodule in changed:
        memo[id(submodule)].__dict__.update(copy.deepcopy(_plain_state(submodule), memo))
    return copy.deepcopy(module, memo)


def _meta_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor of `tensor`'s full shape (a sharded DTensor's global one) and dtype."""
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


#: What a module's `__dict__` holds for the set-up model and for torch's composable APIs
#: (`fully_shard` keeps its state and registry under keys with this prefix).
_STRATEGY_KEYS = (STATE_KEY, "__composable_api_state_key", "_is_fsdp_managed_module", "_fsdp_use_orig_params")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _plain_state(module: nn.Module) -> dict[str, Any]:
    """`module.__dict__` without Lite's and the strategy's state, and without the hooks that state registered."""
    state = {k: v for k, v in module.__dict__.items() if not k.startswith(_STRATEGY_KEYS)}
    for name in _HOOK_DICTS:
        if name in state:
            state[name] = type(state[name])((i, h) for i, h in state[name].items() if not _strategy_hook(h))
    return state


def _strategy_hook(hook: Any) -> bool:
    """Whether `hook` is a method of a torch composable API's state (FSDP's pre- and post-forward)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed._composable_state import _State

    return isinstance(getattr(hook, "__self__", None), _State)
