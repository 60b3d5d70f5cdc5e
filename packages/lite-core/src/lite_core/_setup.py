"""Setting up models and optimizers: what `LightningLite.setup`, `setup_module` and
`setup_optimizers` do, each object claimed once, the model converted, moved, wrapped by the
strategy and set up in place.

`LightningLite` hands in its strategy, the weak set of objects it has set up and its list of
set-up models (the list its evaluation passes read, so it is appended to, never replaced).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core import _arguments
from lite_core._changes import guard_new_parameters
from lite_core._compile import CompileOptions, unwrap_compiled
from lite_core._loader import LiteDataLoader
from lite_core._set_up_model import LiteModule, set_up_in_place
from lite_core.errors import MisuseError
from lite_core.strategies.strategy import Strategy
from lite_core.wrappers import _LiteOptimizerBase, wrap_optimizer


def setup(strategy: Strategy, set_up: weakref.WeakSet[Any], models: list[LiteModule], model: nn.Module,
          optimizers: tuple[Optimizer, ...], move_to_device: bool,
          loss_fn: Callable[..., torch.Tensor] | None) -> Any:
    """`LightningLite.setup`: the set-up model, or `(model, *optimizers)`."""
    model, compile_options = unwrap_compiled(model)
    _arguments.check_module(model, "setup")
    if not any(isinstance(o, _LiteOptimizerBase) for o in optimizers):
        _arguments.check_optimizers(optimizers, "setup")
        _arguments.check_optimizers_belong(model, optimizers)
    require_environment(strategy, "setup")
    claim(set_up, model, "model")
    for optimizer in optimizers:
        claim(set_up, optimizer, "optimizer")
    model = _prepare_module(strategy, model, move_to_device)
    forward_module, ready = strategy.setup_module_and_optimizers(model, list(optimizers))
    module = _wrap_module(strategy, models, forward_module, model, compile_options, loss_fn)
    if not optimizers:
        return module
    return (module, *(wrap_optimizer(o, strategy) for o in ready))


def setup_module(strategy: Strategy, set_up: weakref.WeakSet[Any], models: list[LiteModule], model: nn.Module,
                 move_to_device: bool, loss_fn: Callable[..., torch.Tensor] | None) -> LiteModule:
    """`LightningLite.setup_module`: the model set up without optimizers."""
    model, compile_options = unwrap_compiled(model)
    _arguments.check_module(model, "setup_module")
    require_environment(strategy, "setup_module")
    claim(set_up, model, "model")
    model = _prepare_module(strategy, model, move_to_device)
    return _wrap_module(strategy, models, strategy.setup_module(model), model, compile_options, loss_fn)


def setup_optimizers(strategy: Strategy, set_up: weakref.WeakSet[Any],
                     optimizers: tuple[Optimizer, ...]) -> list[Optimizer]:
    """`LightningLite.setup_optimizers`: each optimizer set up by the strategy and wrapped."""
    if not any(isinstance(o, _LiteOptimizerBase) for o in optimizers):
        _arguments.check_optimizers(optimizers, "setup_optimizers")
    require_environment(strategy, "setup_optimizers")
    wrapped = []
    for optimizer in optimizers:
        claim(set_up, optimizer, "optimizer")
        wrapped.append(wrap_optimizer(strategy.setup_optimizer(optimizer), strategy))
    return wrapped


def claim(set_up: weakref.WeakSet[Any], obj: Any, kind: str) -> None:
    """Refuse an object (`kind`: model, optimizer, dataloader) that Lite set up before; else remember it."""
    if isinstance(obj, (LiteModule, LiteDataLoader, _LiteOptimizerBase)) or obj in set_up:
        raise MisuseError(f"This {kind} was already set up by Lite: set up each {kind} once and reuse the result.")
    set_up.add(obj)


def require_environment(strategy: Strategy, method: str) -> None:
    """Set up this process's environment for `method()`, or refuse where the processes must be launched first."""
    if strategy.environment_ready:
        return
    if strategy.is_distributed:
        raise MisuseError(
            f"{method}() was called before the processes were launched: call it inside run(), or"
            " after launch()."
        )
    strategy.setup_environment()


def _prepare_module(strategy: Strategy, model: nn.Module, move_to_device: bool) -> nn.Module:
    model = strategy.precision.convert_module(model)
    return strategy.module_to_device(model) if move_to_device else model


def _wrap_module(strategy: Strategy, models: list[LiteModule], forward_module: nn.Module, model: nn.Module,
                 compile_options: CompileOptions | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> LiteModule:
    compiled = None if compile_options is None else strategy.compile_module(forward_module, compile_options)
    compiled = strategy.forward_call(forward_module, compiled, loss_fn)
    routes = (forward_module is not model or compiled is not None or strategy.precision.changes_forward
              or strategy.is_distributed or strategy.routes_module_methods)
    module = set_up_in_place(model, forward_module, strategy, compiled, routes=routes,
                             loads=strategy.routes_load_state_dict, guards=not strategy.follows_conversions,
                             parameters=strategy.routes_named_parameters)
    if not strategy.follows_new_parameters:
        guard_new_parameters(module, strategy.name)
    models.append(module)
    return module  # type: ignore[return-value]
