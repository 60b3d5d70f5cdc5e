"""Wrappers around the user's model and optimizers (the dataloader's is in `lite_core._loader`).

Each behaves like the object it wraps (attribute access, `state_dict`, iteration, `len`) and keeps
the original reachable, while routing the forward pass, the optimizer step and batches through the
strategy and precision.
"""

from __future__ import annotations

from functools import cache, wraps
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.optim import Optimizer

from lite_core._methods import computes_on_input, is_user_method

if TYPE_CHECKING:
    from lite_core._roles import StrategyLike as Strategy


#: Container methods a wrapped module answers when the user's module class has them, so that
#: `model[0]`, `len(model)`, `for layer in model` and `"key" in model` work after `setup()`.
_CONTAINER_METHODS = ("__getitem__", "__len__", "__iter__", "__contains__")


class LiteModule(nn.Module):
    """The user's module as set up by Lite; `forward` applies the precision.

    Every other method of the user's module called with a tensor (`model.generate(ids)`,
    `model.training_step(x, y)`) runs the same way: under the precision and as one forward pass
    through the strategy (`Strategy.call_module_method`); one called without a tensor
    (`model.save_pretrained(folder)`) runs on the user's module as it is, so one rank alone may
    call it. Attributes that are not methods
    (submodules, tensors, config objects) are the user's module's, and `nn.Module`'s own methods
    (`state_dict`, `parameters`, `train`, `to`, ...) keep their meaning.

    `state_dict()` and `load_state_dict()` act on the user's module, so keys are unchanged (also
    for a model passed to `setup` compiled: the strategy wraps the plain module and the result is
    compiled again, `compiled`, which is what the forward pass calls).
    Indexing, `len`, iteration and `in` reach the user's module when its class supports them
    (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`, ...).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> LiteModule:
        original = args[1] if len(args) > 1 else kwargs.get("original_module")
        strategy = args[2] if len(args) > 2 else kwargs.get("strategy")
        if cls is LiteModule and getattr(strategy, "is_distributed", False):
            cls = _TrackedLiteModule
        if original is not None:
            cls = _with_container_methods(cls, type(original))
        return super().__new__(cls)

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, strategy: Strategy,
                 compiled: nn.Module | None = None) -> None:
        super().__init__()
        self._forward_module = forward_module
        self.__dict__["_original_module"] = original_module
        self.__dict__["_strategy"] = strategy
        # Kept outside `_modules` so the per-step lookup skips `nn.Module.__getattr__` (and the
        # compiled module's `_orig_mod.` keys stay out of the state dict).
        self.__dict__["_forward_call"] = compiled if compiled is not None else forward_module
        self.__dict__["_plain_forward"] = not strategy.precision.changes_forward
        self.__dict__["_forward_ran"] = False

    @property
    def module(self) -> nn.Module:
        """The user's own module."""
        return self._original_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_call(*args, **kwargs)
        return precision.convert_output(output)

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The user's method `name` as a forward pass: in the precision, through the strategy."""
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._strategy.call_module_method(self._forward_module, self._original_module, name,
                                                       *args, **kwargs)
        return precision.convert_output(output)

    def _as_forward(self, name: str, method: Any) -> Any:
        @wraps(method)
        def run_as_forward(*args: Any, **kwargs: Any) -> Any:
            if not computes_on_input(args, kwargs):  # save_pretrained(folder): no forward, no collectives
                return method(*args, **kwargs)
            return self._run_method(name, args, kwargs)

        return run_as_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The wrapper itself rarely has hooks: then skip nn.Module's call machinery for it (the
        # user's module still runs its own), and with a precision that changes nothing, call
        # the wrapped module directly. Both save Python calls on every step.
        if (self._forward_hooks or self._forward_pre_hooks or _module_hooks._global_forward_hooks
                or _module_hooks._global_forward_pre_hooks or _module_hooks._global_backward_hooks):
            return super().__call__(*args, **kwargs)
        if self._plain_forward:
            return self._forward_call(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._strategy.load_module_state_dict(self._original_module, state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_module")
            if original is None:  # asked before __init__ ran (e.g. by a patched __init__ wrapper)
                raise
            value = getattr(original, name)
            return self._as_forward(name, value) if is_user_method(original, name, value) else value

    def __repr__(self) -> str:
        return f"LiteModule({self._original_module!r})"


class _TrackedLiteModule(LiteModule):
    """A set-up module under a distributed strategy: notes each forward pass, so that `backward`
    can refuse a loss computed through the user's original module instead (its gradients would
    never be synchronised). One-process strategies use `LiteModule` and pay nothing for this."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_forward_ran"] = True
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_forward_ran"] = True
        return super().forward(*args, **kwargs)

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.__dict__["_forward_ran"] = True
        return super()._run_method(name, args, kwargs)


def forward_ran_since_backward(modules: list[LiteModule], retain: bool) -> bool:
    """Whether any of `modules` ran a forward pass since the last call; forgets it unless `retain`
    (a backward with `retain_graph=True` may be followed by another through the same graph)."""
    ran = any(module.__dict__["_forward_ran"] for module in modules)
    if not retain:
        for module in modules:
            module.__dict__["_forward_ran"] = False
    return ran


@cache
def _with_container_methods(wrapper: type[LiteModule], module_class: type[nn.Module]) -> type[LiteModule]:
    """`wrapper`, or a subclass of it that forwards the container methods `module_class` defines."""
    names = [name for name in _CONTAINER_METHODS if getattr(module_class, name, None) is not None]
    if not names:
        return wrapper

    def forward_to_module(name: str) -> Any:
        def method(self: LiteModule, *args: Any) -> Any:
            return getattr(self._original_module, name)(*args)

        method.__name__ = name
        return method

    methods = {name: forward_to_module(name) for name in names}
    name = f"{wrapper.__name__}[{module_class.__name__}]"
    return type(name, (wrapper,), {"__module__": wrapper.__module__, **methods})


class _LiteOptimizerBase:
    """Methods of a wrapped optimizer; combined with the user's optimizer class at wrap time."""

    _optimizer: Optimizer
    _strategy: Strategy

    @property
    def optimizer(self) -> Optimizer:
        """The user's own optimizer."""
        return self._optimizer

    def step(self, closure: Any = None) -> Any:
        kwargs = {} if closure is None else {"closure": closure}
        return self._strategy.optimizer_step(self._optimizer, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name in ("_optimizer", "_strategy"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def _bind_fast_paths(self) -> None:
        # Instance attributes shadow the class's methods: when neither the strategy nor the
        # precision changes the step, calling the user's `step` saves two calls per step.
        from lite_core.precision.precision import Precision

        plain_step = (self._strategy.steps_optimizers_plainly
                      and type(self._strategy.precision).optimizer_step is Precision.optimizer_step)
        if plain_step:
            object.__setattr__(self, "step", self._optimizer.step)
        object.__setattr__(self, "zero_grad", self._optimizer.zero_grad)

    def __repr__(self) -> str:
        return f"Lite{self._optimizer!r}"


def wrap_optimizer(optimizer: Optimizer, strategy: Strategy) -> Optimizer:
    """An object that is an instance of the optimizer's class but steps through the strategy.

    It holds no state of its own: `param_groups`, `state` and hooks are the user's optimizer's,
    so LR schedulers built on either object see the same values.
    """
    cls = type(f"Lite{type(optimizer).__name__}", (_LiteOptimizerBase, type(optimizer)), {})
    wrapper = object.__new__(cls)
    object.__setattr__(wrapper, "_optimizer", optimizer)
    object.__setattr__(wrapper, "_strategy", strategy)
    wrapper._bind_fast_paths()
    return wrapper  # type: ignore[return-value]


def is_set_up(obj: Any) -> bool:
    """Whether `obj` is a module or optimizer returned by `LightningLite.setup` (or its parts)."""
    return isinstance(obj, (LiteModule, _LiteOptimizerBase))


def original_module(obj: Any) -> Any:
    """The user's own module behind a set-up module; any other object as it is."""
    return obj.module if isinstance(obj, LiteModule) else obj


def forward_module(obj: Any) -> Any:
    """The module the strategy built around a set-up module (e.g. `DistributedDataParallel`, an
    FSDP module, a DeepSpeed engine); any other object as it is."""
    return obj._forward_module if isinstance(obj, LiteModule) else obj


def unwrap_optimizer(obj: Any) -> Any:
    """The optimizer the strategy steps behind a set-up optimizer; any other object as it is."""
    return obj.optimizer if isinstance(obj, _LiteOptimizerBase) else obj
