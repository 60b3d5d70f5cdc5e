"""The models and optimizers one `LightningLite` set up: each object claimed once, the model
converted, moved, wrapped by the strategy and set up in place, and the training-step calls made
through them (`backward`, `no_backward_sync`, `clip_gradients`).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, cast

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core._experts import check_experts_held
from lite_core.errors import MisuseError
from lite_core.model._changes import ParameterGuards
from lite_core.model._module import STATE_KEY, LiteModule, set_up_in_place, state_of
from lite_core.model.compile import CompileOptions, unwrap_compiled
from lite_core.model.optimizer import _LiteOptimizerBase, wrap_optimizer
from lite_core.precision.precision import Precision
from lite_core.strategies.strategy import Strategy
from lite_core.training import _backward
from lite_core.training._checks import check_module, check_optimizers, check_optimizers_belong


class Claims:
    """The objects one `LightningLite` has set up (weakly held): each is set up once."""

    def __init__(self) -> None:
        self._objects: weakref.WeakSet[Any] = weakref.WeakSet()

    def claim(self, obj: Any, kind: str) -> None:
        """Refuse an object (`kind`: model, optimizer, dataloader) set up before; else remember it."""
        if isinstance(obj, (LiteModule, _LiteOptimizerBase)) or obj in self._objects:
            raise MisuseError(f"This {kind} was already set up by Lite: set up each {kind} once and reuse the result.")
        self._objects.add(obj)


class Models:
    """`LightningLite`'s set-up models and optimizers, and the training-step calls through them.

    The precision is the job's, held here: it converts each model, and this room hands it to the
    strategy's calls that compose with it (`setup_module*`, `backward`, `clip_gradients_*`), as the
    set-up optimizer does to `optimizer_step`; the strategy holds none.

    `set_up` is the list of set-up models that the loaders' evaluation passes also read: it is
    appended to, never replaced.
    """

    def __init__(self, strategy: Strategy, precision: Precision, claims: Claims, set_up: list[LiteModule],
                 evaluations: _backward.Evaluating) -> None:
        self._strategy = strategy
        self._precision = precision
        self._claims = claims
        self._set_up = set_up
        self._guards = ParameterGuards()  # the new-parameter refusal of the models set up here
        self._evaluations = evaluations
        # Neither the strategy nor the precision changes backward, and with one process there is
        # no gradient synchronisation that a loss from the original model would skip: call it directly.
        self._plain_backward = _backward.is_plain_backward(strategy, precision) and not strategy.is_distributed

    def setup(self, model: nn.Module, optimizers: tuple[Optimizer, ...], move_to_device: bool,
              loss_fn: Callable[..., torch.Tensor] | None, forward_methods: tuple[str, ...] = ()) -> Any:
        """`LightningLite.setup`: the set-up model, or `(model, *optimizers)`."""
        model, compile_options = unwrap_compiled(model)
        check_module(model, "setup")
        check_experts_held(model, self._strategy.name, self._strategy.holds_expert_parallel)
        if not any(isinstance(o, _LiteOptimizerBase) for o in optimizers):
            check_optimizers(optimizers, "setup")
            check_optimizers_belong(model, optimizers)
        require_environment(self._strategy, "setup")
        self._claims.claim(model, "model")
        for optimizer in optimizers:
            self._claims.claim(optimizer, "optimizer")
        model = _prepare_module(self._strategy, self._precision, model, move_to_device, optimizers)
        forward_module, ready = self._strategy.setup_module_and_optimizers(model, list(optimizers),
                                                                           precision=self._precision)
        module = self._wrap_module(forward_module, model, compile_options, loss_fn, forward_methods)
        if not optimizers:
            return module
        return (module, *(wrap_optimizer(o, self._strategy, self._precision) for o in ready))

    def setup_module(self, model: nn.Module, move_to_device: bool,
                     loss_fn: Callable[..., torch.Tensor] | None, forward_methods: tuple[str, ...] = ()) -> LiteModule:
        """`LightningLite.setup_module`: the model set up without optimizers."""
        model, compile_options = unwrap_compiled(model)
        check_module(model, "setup_module")
        check_experts_held(model, self._strategy.name, self._strategy.holds_expert_parallel)
        require_environment(self._strategy, "setup_module")
        self._claims.claim(model, "model")
        model = _prepare_module(self._strategy, self._precision, model, move_to_device)
        forward_module = self._strategy.setup_module(model, precision=self._precision)
        return self._wrap_module(forward_module, model, compile_options, loss_fn, forward_methods)

    def setup_optimizers(self, optimizers: tuple[Optimizer, ...]) -> Any:
        """`LightningLite.setup_optimizers`: each optimizer set up by the strategy and wrapped (one
        alone, several as a tuple)."""
        if not any(isinstance(o, _LiteOptimizerBase) for o in optimizers):
            check_optimizers(optimizers, "setup_optimizers")
        require_environment(self._strategy, "setup_optimizers")
        wrapped = []
        for optimizer in optimizers:
            self._claims.claim(optimizer, "optimizer")
            wrapped.append(wrap_optimizer(self._strategy.setup_optimizer(optimizer), self._strategy, self._precision))
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def holder_of(self, module: nn.Module) -> tuple[LiteModule, str] | None:
        """`(set-up model, "prefix.")` where `module` is a submodule of a set-up model (the base
        model that peft's `merge_and_unload()` returns), `None` where it is not (or is one itself)."""
        if isinstance(module, LiteModule):
            return None
        for model in self._set_up:
            for name, submodule in nn.Module.named_modules(model):
                if submodule is module:
                    return model, f"{name}."
        return None

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        """`LightningLite.backward`: `tensor.backward(*args, **kwargs)` through the strategy, after
        the checks (a model set up, the model a loss belongs to where the strategy needs it, a loss
        that went through a set-up model), or directly where nothing in between changes it."""
        if not self._set_up:
            raise MisuseError("backward() was called before any model was set up: call setup(model, optimizer) first.")
        if self._plain_backward:
            tensor.backward(*args, **kwargs)
            return
        strategy = self._strategy
        if model is None and len(self._set_up) > 1 and strategy.backward_needs_model:
            raise MisuseError(
                f"{len(self._set_up)} models are set up and strategy={strategy.name!r} runs backward"
                " through the model the loss belongs to: call backward(loss, model=model)."
            )
        if strategy.is_distributed:
            self._evaluations.check_not_evaluating()
            _backward.check_loss_came_through_setup(strategy, self._set_up, args, kwargs)
        module = model if model is not None else self._set_up[0]
        forward_module = module.__dict__[STATE_KEY].forward_module if isinstance(module, LiteModule) else module
        strategy.backward(tensor, forward_module, *args, precision=self._precision, **kwargs)

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """`LightningLite.no_backward_sync`: the strategy's context that skips gradient synchronisation."""
        if not isinstance(model, LiteModule):
            raise MisuseError("no_backward_sync() needs the model returned by setup(): pass that one.")
        if not enabled:
            return nullcontext()
        return self._strategy.no_backward_sync(state_of(model).forward_module)

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer, clip_val: float | None, max_norm: float | None,
                       norm_type: float, error_if_nonfinite: bool) -> torch.Tensor | None:
        """`LightningLite.clip_gradients`: by value or by total norm (then the norm)."""
        if (clip_val is None) == (max_norm is None):
            raise MisuseError("clip_gradients() needs exactly one of clip_val and max_norm: pass one of them.")
        inner = optimizer.optimizer if isinstance(optimizer, _LiteOptimizerBase) else optimizer
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(model, inner, max_norm, norm_type, error_if_nonfinite,
                                                      precision=self._precision)
        self._strategy.clip_gradients_value(model, inner, cast(float, clip_val), precision=self._precision)
        return None


    def _wrap_module(self, forward_module: nn.Module, model: nn.Module, compile_options: CompileOptions | None,
                     loss_fn: Callable[..., torch.Tensor] | None, forward_methods: tuple[str, ...]) -> LiteModule:
        """`model` made the set-up model around what the strategy built (`forward_module`)."""
        strategy = self._strategy
        compiled = None if compile_options is None else strategy.compile_module(forward_module, compile_options)
        compiled = strategy.forward_call(forward_module, compiled, loss_fn)
        routes = (forward_module is not model or compiled is not None or self._precision.changes_forward
                  or strategy.is_distributed or strategy.routes_module_methods)
        module = set_up_in_place(model, forward_module, strategy, self._precision, compiled, routes=routes,
                                 loads=strategy.routes_load_state_dict, guards=not strategy.follows_conversions,
                                 parameters=strategy.routes_named_parameters, named_methods=forward_methods)
        if not strategy.follows_new_parameters:
            self._guards.guard(module, strategy.name)
        self._set_up.append(module)  # type: ignore[arg-type]
        return module  # type: ignore[return-value]


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


def _prepare_module(strategy: Strategy, precision: Precision, model: nn.Module, move_to_device: bool,
                    optimizers: tuple[Optimizer, ...] = ()) -> nn.Module:
    before = dict(model.named_parameters())
    model = precision.convert_module(model)
    _follow_replaced_parameters(before, model, optimizers)
    return strategy.module_to_device(model) if move_to_device else model


def _follow_replaced_parameters(before: dict[str, nn.Parameter], model: nn.Module,
                                optimizers: tuple[Optimizer, ...]) -> None:
    """Give `optimizers` the parameters that the precision's conversion put in place of those they
    held (torchao's float8 all-gather wraps each weight in a new `Parameter`), state included."""
    replaced = {id(old): new for name, new in model.named_parameters()
                if (old := before.get(name)) is not None and old is not new}
    if not replaced:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"][:] = [replaced.get(id(p), p) for p in group["params"]]
        for old in [p for p in optimizer.state if id(p) in replaced]:
            optimizer.state[replaced[id(old)]] = optimizer.state.pop(old)
