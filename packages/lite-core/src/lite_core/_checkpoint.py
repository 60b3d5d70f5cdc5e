"""Turns checkpoint content into plain state and restores it into live objects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from lite_core.errors import CheckpointError

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy

#: Key under which the precision plugin's state (e.g. the gradient scaler) is stored.
PRECISION_KEY = "lite_precision"


def to_state(content: dict[str, Any], strategy: Strategy) -> dict[str, Any]:
    """`content` with every module and optimizer replaced by its `state_dict()`."""
    state = {key: _state_of(value) for key, value in content.items()}
    precision_state = strategy.precision.state_dict()
    if precision_state:
        state[PRECISION_KEY] = precision_state
    return state


def _state_of(value: Any) -> Any:
    if isinstance(value, (nn.Module, Optimizer)):
        return value.state_dict()
    return value


def restore(state: dict[str, Any], content: dict[str, Any], strict: bool, strategy: Strategy) -> None:
    """Load `content` into the objects of `state` in place; plain values are replaced."""
    missing = [key for key in state if key not in content]
    if strict and missing:
        raise CheckpointError(
            f"The checkpoint has no entry for {missing}: save them too, or load with strict=False."
        )
    if PRECISION_KEY in content:
        strategy.precision.load_state_dict(content.pop(PRECISION_KEY))
    for key, target in list(state.items()):
        if key not in content:
            continue
        if isinstance(target, nn.Module):
            target.load_state_dict(content[key], strict=strict)
        elif isinstance(target, Optimizer) or hasattr(target, "load_state_dict"):
            target.load_state_dict(content[key])
        else:
            state[key] = content[key]
