"""Detects `loss.backward()` called directly on a DeepSpeed model's output instead of `backward()`.

DeepSpeed must run the backward pass itself (loss scaling, gradient reduction into the shards);
a plain `loss.backward()` could otherwise train silently wrong. Every floating-point output of
the engine that requires a gradient gets a tensor hook that checks, when its gradient is
computed, that the strategy is running the backward pass. The output itself is handed back
unchanged (no view, no copy), so in-place operations on it work as in plain PyTorch.
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
        """Check the backward passes through `engine`'s outputs."""
        engine.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            tree_map_only(torch.Tensor, self._watch, output)

    def _watch(self, tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            tensor.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> None:
        if not self.running:
            raise MisuseError(
                "loss.backward() was called on a DeepSpeed model's output: call lite.backward(loss)"
                " instead, so that DeepSpeed scales and reduces the gradients."
            )
