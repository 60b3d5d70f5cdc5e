"""Strategies and precisions declare what their methods change (`Strategy.changes_backward`,
`moves_batches_plainly`, `steps_optimizers_plainly`, `routes_*`, `Precision.changes_backward`,
`changes_optimizer_step`): a subclass that overrides a method only to log, calling the base's,
keeps the plain routing of its base, where Lite calls the user's objects directly."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lite_core import LightningLite
from lite_core.precision.precision import Precision
from lite_core.strategies import SingleDeviceStrategy


class _LogsBackwardAndStep:
    """Overrides `backward` and `optimizer_step` (a strategy's or a precision's) only to log the call."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.log.append("backward")
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self.log.append("optimizer_step")
        return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]


class _LoggingStrategy(_LogsBackwardAndStep, SingleDeviceStrategy):
    """Overrides every routed method only to log the call; declares nothing."""

    def batch_to_device(self, batch: Any) -> Any:
        self.log.append("batch_to_device")
        return super().batch_to_device(batch)

    def call_module_method(self, forward_module: nn.Module, module: nn.Module, name: str,
                           *args: Any, **kwargs: Any) -> Any:
        self.log.append("call_module_method")
        return super().call_module_method(forward_module, module, name, *args, **kwargs)

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any:
        self.log.append("load_module_state_dict")
        return super().load_module_state_dict(module, state_dict, strict, assign)

    def module_named_parameters(self, module: nn.Module, forward_module: nn.Module, prefix: str = "",
                                recurse: bool = True, remove_duplicate: bool = True) -> Any:
        self.log.append("module_named_parameters")
        return super().module_named_parameters(module, forward_module, prefix, recurse, remove_duplicate)


class _LoggingPrecision(_LogsBackwardAndStep, Precision):
    """`32-true` whose backward and step log the call; declares nothing."""


class _Net(nn.Linear):
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).sign()


def _train_one_step(lite: LightningLite) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    user_optimizer = torch.optim.SGD((net := _Net(2, 1)).parameters(), lr=0.1)
    model, optimizer = lite.setup(net, user_optimizer, forward_methods=["predict"])
    (batch,) = lite.setup_dataloaders(DataLoader([torch.ones(2)] * 2, batch_size=2))
    model.predict(batch)
    lite.backward(model(batch).sum())
    optimizer.step()
    model.load_state_dict(nn.Linear(2, 1).state_dict())
    list(model.parameters())
    return model, optimizer, user_optimizer


def test_a_strategy_that_overrides_methods_only_to_log_keeps_the_plain_routing() -> None:
    strategy = _LoggingStrategy()
    model, optimizer, user_optimizer = _train_one_step(LightningLite(accelerator="cpu", strategy=strategy))
    assert strategy.log == []  # every call went straight to the user's objects, as under the base
    assert optimizer.step == user_optimizer.step
    for method in ("__call__", "predict", "load_state_dict", "named_parameters"):
        assert getattr(type(model), method) is getattr(_Net, method), method


def test_a_precision_that_overrides_methods_only_to_log_keeps_the_plain_routing() -> None:
    precision = _LoggingPrecision()
    _, optimizer, user_optimizer = _train_one_step(LightningLite(accelerator="cpu", plugins=precision))
    assert precision.log == []
    assert optimizer.step == user_optimizer.step


def test_a_declared_change_routes_every_call_through_the_strategy_and_precision() -> None:
    class Declaring(_LoggingStrategy):
        changes_backward = True
        moves_batches_plainly = False
        steps_optimizers_plainly = False
        routes_module_methods = True
        routes_load_state_dict = True
        routes_named_parameters = True

    class DeclaringPrecision(_LoggingPrecision):
        changes_backward = True
        changes_optimizer_step = True

    strategy, precision = Declaring(), DeclaringPrecision()
    _train_one_step(LightningLite(accelerator="cpu", strategy=strategy, plugins=precision))
    assert strategy.log == ["batch_to_device", "call_module_method", "backward", "optimizer_step", "load_module_state_dict",
                            "module_named_parameters"]
    assert precision.log == ["backward", "optimizer_step"]
