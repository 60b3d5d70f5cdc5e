"""Changes to a set-up model that its strategy cannot follow are refused at once, before they happen.

`DistributedDataParallel` records the model's parameters and buffers when it is built: its
gradient buckets hold the parameters' dtype, its buffer broadcast the buffer tensors. After
`model.double()` (or `.half()`, or a move to another device) the model computes with new tensors
that DDP no longer averages, so the ranks drift apart without an error; a parameter added after
setup (a new head) is trained on each rank alone, and a sharded strategy (FSDP, DeepSpeed) never
shards or reduces it either. A strategy says which changes it follows
(`Strategy.follows_conversions`, `Strategy.follows_new_parameters`); the others are refused here
in one sentence that names the fix.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from lite_core.errors import MisuseError

if TYPE_CHECKING:
    from lite_core._roles import Named


class _Guard:
    __slots__ = ("strategy_name", "parameter_ids")

    def __init__(self, strategy_name: str, parameter_ids: set[int]) -> None:
        self.strategy_name = strategy_name
        self.parameter_ids = parameter_ids


def refuse_conversion(module: nn.Module, strategy: Named, fn: Callable[[torch.Tensor], Any]) -> None:
    """Raise if `module._apply(fn)` would change the dtype or device of a parameter or buffer
    (found by applying `fn` to an empty tensor of each kind), which `strategy` cannot follow."""
    kinds = {(t.dtype, t.device) for t in (*module.parameters(), *module.buffers())}
    for dtype, device in kinds:
        probe = torch.empty(0, dtype=dtype, device=device)
        converted = fn(probe)
        if isinstance(converted, torch.Tensor) and (converted.dtype, converted.device) != (dtype, device):
            raise MisuseError(
                f"The model was converted from {dtype} on {device} to {converted.dtype} on {converted.device} after"
                f" setup(), which strategy={strategy.name!r} cannot follow (its gradients would no longer be"
                " averaged across processes): convert it before setup(), or pick the dtype with"
                " LightningLite(precision=...)."
            )


class ParameterGuards:
    """The set-up models of one `LightningLite` whose strategy does not follow new parameters, and
    the two module registration hooks (torch's, global to `nn.Module`) that refuse a trainable
    parameter added to them: registered with the first model guarded, removed when the last
    guarded model is gone."""

    def __init__(self) -> None:
        #: Every submodule of a guarded model -> that model's record of its parameters and strategy.
        self._guarded: weakref.WeakKeyDictionary[nn.Module, _Guard] = weakref.WeakKeyDictionary()
        self._handles: list[Any] = []
        self._models = 0

    def guard(self, model: nn.Module, strategy_name: str) -> None:
        """Refuse, from now on, a trainable parameter added anywhere inside `model` (a new head, a
        parameter registered on a submodule) that is not one `model` was set up with."""
        if not self._handles:
            self._handles += [
                _module_hooks.register_module_parameter_registration_hook(functools.partial(_check_parameter, self._guarded)),
                _module_hooks.register_module_module_registration_hook(functools.partial(_check_submodule, self._guarded)),
            ]
        guard = _Guard(strategy_name, {id(p) for p in model.parameters()})
        for submodule in model.modules():
            self._guarded[submodule] = guard
        self._models += 1
        weakref.finalize(model, self._model_gone)

    def _model_gone(self) -> None:
        self._models -= 1
        if not self._models:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()


def _check_parameter(guarded: weakref.WeakKeyDictionary[nn.Module, _Guard], module: nn.Module, name: str,
                     param: Any) -> None:
    guard = guarded.get(module)
    if guard is not None and param is not None and param.requires_grad and id(param) not in guard.parameter_ids:
        _refuse(guard, f"parameter {name!r}")


def _check_submodule(guarded: weakref.WeakKeyDictionary[nn.Module, _Guard], module: nn.Module, name: str,
                     submodule: Any) -> None:
    guard = guarded.get(module)
    if guard is None or submodule is None:
        return
    if any(p.requires_grad and id(p) not in guard.parameter_ids for p in submodule.parameters()):
        _refuse(guard, f"submodule {name!r} with new parameters")


def _refuse(guard: _Guard, what: str) -> None:
    raise MisuseError(
        f"A {what} was added to the model after setup(), and strategy={guard.strategy_name!r} would not"
        " synchronise or shard it (each process would train its own copy): add it before setup(), then set up"
        " the model and an optimizer that holds it."
    )
