"""Detects `loss.backward()` called directly on a DeepSpeed model's output instead of `backward()`.

DeepSpeed must run the backward pass itself (loss scaling, gradient reduction into the shards);
a plain `loss.backward()` could otherwise train silently wrong. Every floating-point output of
the engine passes through an identity autograd function whose backward checks that the strategy
is running the backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lite_core.plugins import MisuseError


class BackwardGuard:
    """Shared by the strategy (which sets `running`) and the forward hooks of its engines."""

    def __init__(self) -> None:
        self.running = False

    def attach(self, engine: nn.Module) -> None:
        """Route `engine`'s outputs through the check."""
        engine.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        return tree_map_only(torch.Tensor, self._guard, output)

    def _guard(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        return _RequireLiteBackward.apply(tensor, self)


class _RequireLiteBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, guard: BackwardGuard) -> torch.Tensor:
        ctx.guard = guard
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if not ctx.guard.running:
            raise MisuseError(
                "loss.backward() was called on a DeepSpeed model's output: call lite.backward(loss)"
                " instead, so that DeepSpeed scales and reduces the gradients."
            )
        return grad, None
