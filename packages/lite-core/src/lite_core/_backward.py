"""`LightningLite.backward`: the checks before a backward pass (a model set up, the model a loss
belongs to where the strategy needs it, a loss that went through a set-up model) and the hand-off
to the strategy, or the plain `tensor.backward()` where nothing in between changes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lite_core._set_up_model import STATE_KEY, LiteModule
from lite_core.errors import MisuseError
from lite_core.strategies.strategy import Strategy
from lite_core.wrappers import forward_ran_since_backward

if TYPE_CHECKING:
    from lite_core._evaluation import EvaluationPasses


def backward(strategy: Strategy, models: list[LiteModule], evaluations: EvaluationPasses, plain: bool,
             tensor: torch.Tensor, model: nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """`tensor.backward(*args, **kwargs)` through `strategy`; `plain`: call it directly (`is_plain_backward`)."""
    if not models:
        raise MisuseError("backward() was called before any model was set up: call setup(model, optimizer) first.")
    if plain:
        tensor.backward(*args, **kwargs)
        return
    if model is None and len(models) > 1 and strategy.backward_needs_model:
        raise MisuseError(
            f"{len(models)} models are set up and strategy={strategy.name!r} runs backward"
            " through the model the loss belongs to: call backward(loss, model=model)."
        )
    if strategy.is_distributed:
        evaluations.check_not_evaluating()
        _check_loss_came_through_setup(strategy, models, args, kwargs)
    module = model if model is not None else models[0]
    forward_module = module.__dict__[STATE_KEY].forward_module if isinstance(module, LiteModule) else module
    strategy.backward(tensor, forward_module, *args, **kwargs)


def is_plain_backward(strategy: Strategy) -> bool:
    """Whether neither the strategy nor the precision changes backward (then `tensor.backward()` is
    it), as they declare (`Strategy.changes_backward`, `Precision.changes_backward`)."""
    return (not strategy.changes_backward and not strategy.precision.changes_backward
            and not strategy.backward_needs_model)


def _check_loss_came_through_setup(strategy: Strategy, models: list[LiteModule], args: tuple[Any, ...],
                                   kwargs: dict[str, Any]) -> None:
    retain = kwargs.get("retain_graph", args[1] if len(args) > 1 else None)
    if retain is None:
        retain = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
    if not forward_ran_since_backward(models, bool(retain)):
        raise MisuseError(
            "backward() got a loss that no set-up model computed since the last backward(), so"
            f" strategy={strategy.name!r} would not synchronise its gradients: compute it by calling a"
            " model passed to setup() (model(x), not model.forward(x))."
        )
