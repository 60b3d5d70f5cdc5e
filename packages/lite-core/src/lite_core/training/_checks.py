"""Checks of what `setup()`, `setup_module()` and `setup_optimizers()` are given, before anything
is set up."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lite_core.errors import MisuseError


def check_module(model: Any, method: str) -> None:
    if not isinstance(model, nn.Module):
        raise MisuseError(f"{method}() takes the model first but got {type(model).__name__}: pass your torch.nn.Module.")


def check_optimizers(optimizers: tuple[Any, ...], method: str) -> None:
    for optimizer in optimizers:
        if not isinstance(optimizer, Optimizer):
            raise MisuseError(
                f"{method}() got {type(optimizer).__name__} where an optimizer belongs: pass torch.optim.Optimizer"
                " objects built from the model's parameters."
            )


def check_optimizers_belong(model: nn.Module, optimizers: tuple[Optimizer, ...]) -> None:
    owned = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if owned and params and not any(id(p) in owned for p in params):
            raise MisuseError(
                f"An optimizer passed to setup() with {type(model).__name__} holds none of its parameters: build it"
                " from model.parameters(), or set it up together with the model it belongs to."
            )
