"""The optimizer that `setup(model, optimizer)` hands back under DeepSpeed."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


class DeepSpeedEngineOptimizer(Optimizer):
    """The user's optimizer as DeepSpeed drives it: `step` and `zero_grad` go through the engine.

    Under ZeRO the user's optimizer updates DeepSpeed's fp32 shards, so clearing its gradients
    directly would drop buffers that DeepSpeed reuses. `param_groups`, `state` and `defaults`
    are the user's optimizer's, so learning-rate schedulers work as usual.
    """

    def __init__(self, engine: Any, optimizer: Optimizer) -> None:  # no Optimizer.__init__: nothing to own
        self.engine = engine
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One optimizer step of the engine (DeepSpeed reduces, clips, unscales and steps)."""
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients the way the engine's optimizer does."""
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DeepSpeedEngineOptimizer({self.optimizer!r})"
