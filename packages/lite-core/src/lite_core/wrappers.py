"""Wrappers around the user's optimizers (the dataloader's is in `lite_core._loader`), and the
functions that find the parts of a set-up model (which is the user's own module, see
`_set_up_model.py`).

Each wrapper behaves like the object it wraps (attribute access, `state_dict`, iteration, `len`)
and keeps the original reachable, while routing the optimizer step and batches through the
strategy and precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from lite_core._set_up_model import STATE_KEY, LiteModule, is_set_up_model, state_of

if TYPE_CHECKING:
    from lite_core._roles import StrategyLike as Strategy


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
        # precision changes the step (as they declare), calling the user's `step` saves two calls per step.
        plain_step = (self._strategy.steps_optimizers_plainly
                      and not self._strategy.precision.changes_optimizer_step)
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
    """The user's own module behind a set-up module: since the set-up model is the user's module,
    `obj` itself (kept for backends written against the wrapper of Lite 1.5)."""
    return obj


def forward_module(obj: Any) -> Any:
    """What the strategy built around a set-up module (e.g. `DistributedDataParallel`, a DeepSpeed
    engine; the module itself under FSDP, whose `fully_shard` works in place); any other object as it is."""
    return state_of(obj).forward_module if is_set_up_model(obj) else obj


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


def unwrap_optimizer(obj: Any) -> Any:
    """The optimizer the strategy steps behind a set-up optimizer; any other object as it is."""
    return obj.optimizer if isinstance(obj, _LiteOptimizerBase) else obj
