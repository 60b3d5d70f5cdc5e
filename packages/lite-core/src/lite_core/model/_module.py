"""The set-up model is the user's own module, its class swapped in place for a subclass.

`setup(model)` returns `model` itself: the same object, with the same `__dict__`, parameters,
buffers, submodules and hooks. Only its class changes, to a subclass of the user's class created
once per class (as torch's `fully_shard` does with `FSDP<Class>`), which adds what Lite needs:

- `model(x)` runs through the strategy's wrapper (`DistributedDataParallel`, a DeepSpeed engine,
  a compiled module) under the precision. The wrapper holds the same object and calls it; while
  the strategy works on the model (`_SetUp.busy`), the model is plainly the user's module, so that
  inner call is `nn.Module.__call__` and the user's forward, hooks and all.
- `model.generate(ids)` and the methods named in `setup(forward_methods=[...])` run the same way,
  as one forward pass of the strategy; every other method runs on the module as it is, whatever
  its arguments (`_methods.py`).
- `load_state_dict` goes through the strategy where it has its own (sharded strategies take full
  weights), and so does `named_parameters()` (so `parameters()`) where the parameters that train
  are not the module's own (torch-xla's FSDP moves them onto its wrapper).
- Under a strategy that cannot follow a dtype or device change (DDP's gradient buckets), such a
  change (`model.double()`) is refused before anything moves (`_changes.py`, which also refuses
  new parameters there).

Everything else is the user's class: names, `modules()`, attribute and submodule assignment,
every kind of hook, `state_dict`, `isinstance`. A one-process strategy with a precision that
changes nothing gets a subclass that overrides nothing on the step path.
"""

from __future__ import annotations

import copyreg
from functools import cache, wraps
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from lite_core.model._changes import refuse_conversion
from lite_core.model._methods import forward_methods

if TYPE_CHECKING:
    from lite_core._roles import RoutesModule
    from lite_core.precision.precision import Precision

#: The key of Lite's record in the set-up model's `__dict__` (outside `_modules`, `_parameters`
#: and `_buffers`, so it is in no name, state dict or `modules()`).
STATE_KEY = "_lite_set_up"


class _SetUp:
    """What Lite keeps on a set-up model: the strategy and the job's precision, what the strategy
    built around the model, and whether the strategy is at work on it right now."""

    __slots__ = ("strategy", "precision", "forward_module", "forward_call", "user_class", "plain_forward", "busy",
                 "forward_ran")

    def __init__(self, strategy: RoutesModule, precision: Precision, forward_module: nn.Module, forward_call: Callable[..., Any],
                 user_class: type[nn.Module]) -> None:
        self.strategy = strategy
        self.precision = precision
        self.forward_module = forward_module
        self.forward_call = forward_call
        self.user_class = user_class
        self.plain_forward = not precision.changes_forward
        self.busy = False
        self.forward_ran = False


class LiteModule:
    """Marks a set-up model (the user's module after `setup()`); the first base of its class.

    It defines only what every set-up model needs off the step path: construction of the user's
    class where code calls `type(model)(...)` (slicing an `nn.Sequential`), and pickling and
    `copy.deepcopy` as a plain module of the user's class (an EMA copy), without Lite's record.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            # `self.__new__(type(self))`, as torch's copies make them (DataParallel's replicas):
            # a bare instance whose `__dict__` the caller fills in.
            return object.__new__(cls)
        # `type(model)(...)` builds the user's class, not a second set-up model.
        return cls.__bases__[-1](*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Rebuilt by the standard library alone (`copyreg`), so loading needs no Lite.
        own = self.__getstate__().items()  # type: ignore[attr-defined]
        state = {key: value for key, value in own if key != STATE_KEY}
        return copyreg._reconstructor, (self.__dict__[STATE_KEY].user_class, object, None), state


class _Calls:
    """`model(x)` through the strategy's wrapper and the precision."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__[STATE_KEY]
        if state.busy:  # the strategy's wrapper calling the module it holds
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        state.forward_ran = True
        state.busy = True
        try:
            if state.plain_forward:  # the precision changes nothing: one call less per step
                return state.forward_call(*args, **kwargs)
            return _through_precision(state, state.forward_call, args, kwargs)
        finally:
            state.busy = False


class _LoadsThroughStrategy:
    """`load_state_dict` as the strategy loads (full weights into a sharded model)."""

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        state = self.__dict__[STATE_KEY]
        if state.busy:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        state.busy = True
        try:
            return state.strategy.load_module_state_dict(self, state_dict, strict=strict, assign=assign)
        finally:
            state.busy = False


class _ParametersThroughStrategy:
    """`named_parameters()` (and so `parameters()`) as the strategy says, where the parameters
    that train are not the module's own (torch-xla's FSDP moves them onto its wrapper)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        state = self.__dict__[STATE_KEY]
        if state.busy:  # the strategy's own code, on the module it holds
            return super().named_parameters(prefix, recurse, remove_duplicate)  # type: ignore[misc]
        return state.strategy.module_named_parameters(self, state.forward_module, prefix, recurse, remove_duplicate)


class _GuardsChanges:
    """Refuses a dtype or device change that the strategy cannot follow, before it happens."""

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        refuse_conversion(self, self.__dict__[STATE_KEY].strategy, fn)
        return super()._apply(fn, *args, **kwargs)  # type: ignore[misc]


def _through_precision(state: _SetUp, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    precision = state.precision
    if not precision.changes_forward:
        return call(*args, **kwargs)
    args, kwargs = precision.convert_input((args, kwargs))
    with precision.forward_context():
        output = call(*args, **kwargs)
    return precision.convert_output(output)


def _routed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, a forward method of the user's class (`_methods.py`), run as one forward pass
    of the strategy when it is called from outside the strategy; as it is inside."""

    @wraps(function)
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__[STATE_KEY]
        if state.busy:
            return function(self, *args, **kwargs)
        state.forward_ran = True
        state.busy = True
        try:
            return _through_precision(state, _call_method(state, self, name), args, kwargs)
        finally:
            state.busy = False

    return method


def _call_method(state: _SetUp, module: nn.Module, name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return state.strategy.call_module_method(state.forward_module, module, name, *args, **kwargs)

    return call


@cache
def set_up_class(user_class: type[nn.Module], calls: bool, methods: tuple[str, ...], loads: bool, guards: bool,
                 parameters: bool) -> type:
    """The subclass of `user_class` a set-up model gets; only the parts asked for are added, so a
    plain one-process model's step runs nothing of Lite's. `methods`: the names of the methods
    that run as a forward pass (none where nothing routes)."""
    mixins: list[type] = [LiteModule]
    if calls:
        mixins.append(_Calls)
    if loads:
        mixins.append(_LoadsThroughStrategy)
    if parameters:
        mixins.append(_ParametersThroughStrategy)
    if guards:
        mixins.append(_GuardsChanges)
    body: dict[str, Any] = {"__module__": user_class.__module__, "__qualname__": user_class.__qualname__}
    functions = forward_methods(user_class, methods) if methods else {}
    body.update({name: _routed(name, function) for name, function in functions.items()})
    return type(user_class.__name__, (*mixins, user_class), body)


def set_up_in_place(module: nn.Module, forward_module: nn.Module, strategy: RoutesModule, precision: Precision,
                    compiled: nn.Module | None, *, routes: bool, loads: bool, guards: bool, parameters: bool,
                    named_methods: tuple[str, ...] = ()) -> nn.Module:
    """Make `module` the set-up model: the same object, its class a subclass of its own.

    Args:
        module: the user's module, as the strategy left it (`fully_shard` may have swapped its class already).
        forward_module: what the strategy built around `module` (or `module` itself).
        strategy: the strategy the model's forward, `load_state_dict` and methods go through.
        precision: the job's precision plugin, which applies to every forward pass.
        compiled: the compiled `forward_module`, when the user set up a compiled model.
        routes: whether `model(x)` and the user's methods must go through the strategy (a wrapper,
            a compiled module, a precision that changes the forward, a strategy's own method call).
        loads: whether `load_state_dict` goes through the strategy's.
        guards: whether dtype and device changes are refused (the strategy cannot follow them).
        parameters: whether `named_parameters()` goes through the strategy's (they live on its wrapper).
        named_methods: the user's `setup(forward_methods=...)`: methods that run as a forward pass
            besides `generate` (checked to exist even where nothing routes).
    """
    user_class = type(module)
    methods = tuple(forward_methods(user_class, named_methods))  # refuses a name the class lacks
    if compiled is not None:
        forward_call: Callable[..., Any] = compiled
    elif forward_module is module:
        forward_call = nn.Module.__call__.__get__(module)  # the module itself, plainly
    else:
        forward_call = forward_module
    module.__dict__[STATE_KEY] = _SetUp(strategy, precision, forward_module, forward_call, user_class)
    module.__class__ = set_up_class(user_class, routes, methods if routes else (), loads, guards, parameters)
    return module


def is_set_up_model(obj: Any) -> bool:
    """Whether `obj` is a model that `setup()` returned."""
    return isinstance(obj, LiteModule)


def user_class_of(module: nn.Module) -> type[nn.Module]:
    """The user's own class of `module`: the first module class in its MRO that neither `setup()`
    (`LiteModule`) nor torch's `fully_shard` (`FSDP<Class>`) made of it."""
    made = (LiteModule, *_sharded_module_classes())
    return next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, made))


def _sharded_module_classes() -> tuple[type, ...]:
    import torch.distributed

    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule

    return (FSDPModule,)


def state_of(model: nn.Module) -> _SetUp:
    """Lite's record on a set-up model."""
    return model.__dict__[STATE_KEY]


def forward_ran_since_backward(modules: list[Any], retain: bool) -> bool:
    """Whether any of the set-up `modules` ran a forward pass since the last call; forgets it unless
    `retain` (a backward with `retain_graph=True` may be followed by another through the same graph)."""
    ran = False
    for module in modules:  # once per backward: no helper calls
        state = module.__dict__[STATE_KEY]
        ran = ran or state.forward_ran
        if not retain:
            state.forward_ran = False
    return ran
