"""The set-up optimizer: an instance of the user's optimizer class whose `step()` goes through the
strategy and precision, holding no state of its own (`param_groups`, `state` and hooks are the
user's optimizer's), and `unwrap_optimizer`, which finds the optimizer behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer


if TYPE_CHECKING:
    from lite_core._roles import StepsOptimizers
    from lite_core.precision.precision import Precision


class _LiteOptimizerBase:
    """Methods of a wrapped optimizer; combined with the user's optimizer class at wrap time."""

    _optimizer: Optimizer
    _strategy: StepsOptimizers
    _precision: Precision

    @property
    def optimizer(self) -> Optimizer:
        """The user's own optimizer."""
        return self._optimizer

    def step(self, closure: Any = None) -> Any:
        kwargs = {} if closure is None else {"closure": closure}
        return self._strategy.optimizer_step(self._optimizer, precision=self._precision, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name in ("_optimizer", "_strategy", "_precision"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def _bind_fast_paths(self, plain_step: bool) -> None:
        # Instance attributes shadow the class's methods: when neither the strategy nor the
        # precision changes the step (as they declare), calling the user's `step` saves two calls per step.
        if plain_step:
            object.__setattr__(self, "step", self._optimizer.step)
        object.__setattr__(self, "zero_grad", self._optimizer.zero_grad)

    def __repr__(self) -> str:
        return f"Lite{self._optimizer!r}"


def wrap_optimizer(optimizer: Optimizer, strategy: StepsOptimizers, precision: Precision) -> Optimizer:
    """An object that is an instance of the optimizer's class but steps through the strategy, which
    it hands `precision` (the job's) at each step.

    It holds no state of its own: `param_groups`, `state` and hooks are the user's optimizer's,
    so LR schedulers built on either object see the same values. Where neither the strategy nor
    `precision` (the job's) changes the step, its `step` is the user's own.
    """
    cls = type(f"Lite{type(optimizer).__name__}", (_LiteOptimizerBase, type(optimizer)), {})
    wrapper = object.__new__(cls)
    object.__setattr__(wrapper, "_optimizer", optimizer)
    object.__setattr__(wrapper, "_strategy", strategy)
    object.__setattr__(wrapper, "_precision", precision)
    wrapper._bind_fast_paths(strategy.steps_optimizers_plainly and not precision.changes_optimizer_step)
    return wrapper  # type: ignore[return-value]


def unwrap_optimizer(obj: Any) -> Any:
    """The optimizer the strategy steps behind a set-up optimizer; any other object as it is."""
    return obj.optimizer if isinstance(obj, _LiteOptimizerBase) else obj
