"""Activation checkpointing (recompute) on the user's own blocks, with torch's composable
`checkpoint` (`torch.distributed._composable.checkpoint`): each block's activations are dropped
after its forward pass and recomputed in the backward pass.

The composable `checkpoint` hangs hooks on the block itself and wraps nothing, so the set-up model
keeps its module names and state-dict keys (a checkpoint saved with recompute loads without it),
where `checkpoint_wrapper` would insert `_checkpoint_wrapped_module.` into every key.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from lite_core.errors import ConfigurationError, MisuseError


@dataclass(frozen=True)
class Recompute:
    """The block classes whose activations are recomputed, and torch's per-op policy (or `None`)."""

    blocks: tuple[type[nn.Module], ...]
    policy: Any = None

    def apply(self, module: nn.Module) -> nn.Module:
        """Checkpoint every outermost block of `module` in place; `module` is returned as it is."""
        from torch.distributed._composable import checkpoint

        blocks = outermost_blocks(module, self.blocks)
        if not blocks:
            names = ", ".join(cls.__name__ for cls in self.blocks)
            raise MisuseError(
                f"activation_checkpointing names {names}, of which {type(module).__name__} holds no submodule:"
                " pass the classes of your model's own blocks (such as activation_checkpointing={Block})."
            )
        options = {} if self.policy is None else {"context_fn": self._context_fn()}
        for block in blocks:
            if checkpoint.state(block) is None:  # one checkpointed already (by you, or an earlier setup) stays
                checkpoint(block, **options)
        return module

    def _context_fn(self) -> Callable[[], Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return functools.partial(create_selective_checkpoint_contexts, self.policy)


def outermost_blocks(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The submodules of `module` (not `module` itself) of one of `classes`, skipping those inside
    another match, whose recompute covers them already."""
    found: list[nn.Module] = []
    covered: set[str] = set()
    for name, submodule in module.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in covered):
            continue
        if isinstance(submodule, classes):
            found.append(submodule)
            covered.add(name)
    return found


def recompute(blocks: Any, policy: Any = None) -> Recompute | None:
    """The checked `activation_checkpointing` / `activation_checkpointing_policy` arguments;
    `None` without blocks."""
    if blocks is None:
        if policy is not None:
            raise ConfigurationError(
                "activation_checkpointing_policy was given without activation_checkpointing: name the block classes"
                " to recompute as well, such as activation_checkpointing={Block}."
            )
        return None
    classes = (blocks,) if isinstance(blocks, type) else tuple(blocks) if isinstance(blocks, Iterable) else (blocks,)
    if not classes or not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise ConfigurationError(
            f"activation_checkpointing={blocks!r} is not valid: pass a module class or a set of them (your"
            " model's blocks, such as activation_checkpointing={Block})."
        )
    if policy is not None and not callable(policy) and not _is_op_list(policy):
        raise ConfigurationError(
            f"activation_checkpointing_policy={policy!r} is not valid: pass torch's policy function"
            " policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops whose outputs to save (such as torch.ops.aten.mm.default)."
        )
    return Recompute(classes, policy)


def _is_op_list(policy: Any) -> bool:
    import torch

    return isinstance(policy, list) and all(isinstance(op, torch._ops.OpOverload) for op in policy)
