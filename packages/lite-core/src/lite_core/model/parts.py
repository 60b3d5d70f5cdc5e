"""The parts of a set-up model and optimizer, for backends: whether an object was set up, the
user's module behind it, and what the strategy built around it. The set-up model is the user's own
module (its class swapped for a subclass, see `lite_core.model._module`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lite_core.model._module import LiteModule, is_set_up_model, state_of
from lite_core.model.optimizer import _LiteOptimizerBase


def is_set_up(obj: Any) -> bool:
    """Whether `obj` is a module or optimizer returned by `LightningLite.setup` (or its parts)."""
    return isinstance(obj, (LiteModule, _LiteOptimizerBase))


def original_module(obj: Any) -> Any:
    """The user's own module behind a set-up module: since the set-up model is the user's module,
    `obj` itself (kept for backends written against the wrapper of Lite 1.5)."""
    return obj


def forward_module(obj: Any) -> Any:
    """What the strategy built around a set-up module (e.g. `DistributedDataParallel`, a DeepSpeed
    engine; the module itself under FSDP, whose `fully_shard` works in place); any other object as it is."""
    return state_of(obj).forward_module if is_set_up_model(obj) else obj


def trainable_names(module: nn.Module) -> list[str]:
    """The state-dict names of `module`'s parameters that train (`requires_grad`), in its order."""
    return [name for name, parameter in nn.Module.named_parameters(module) if parameter.requires_grad]
