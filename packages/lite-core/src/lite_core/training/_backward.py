"""What `LightningLite.backward` decides before a backward pass: whether `tensor.backward()` is
all it takes (nothing in the strategy or precision changes it), and whether a loss went through a
set-up model since the last backward (else the strategy would not synchronise its gradients).
"""

from __future__ import annotations

from typing import Any, Protocol

from lite_core.errors import MisuseError
from lite_core.model._module import LiteModule, forward_ran_since_backward
from lite_core.precision.precision import Precision
from lite_core.strategies.strategy import Strategy


class Evaluating(Protocol):
    """The evaluation passes of the same `LightningLite`'s loaders, as `backward()` asks about them."""

    def check_not_evaluating(self) -> None: ...


def is_plain_backward(strategy: Strategy, precision: Precision) -> bool:
    """Whether neither the strategy nor the precision changes backward (then `tensor.backward()` is
    it), as they declare (`Strategy.changes_backward`, `Precision.changes_backward`)."""
    return not strategy.changes_backward and not precision.changes_backward and not strategy.backward_needs_model


def check_loss_came_through_setup(strategy: Strategy, models: list[LiteModule], args: tuple[Any, ...],
                                   kwargs: dict[str, Any]) -> None:
    retain = kwargs.get("retain_graph", args[1] if len(args) > 1 else None)
    if retain is None:
        retain = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
    if not forward_ran_since_backward(models, bool(retain)):
        raise MisuseError(
            "backward() got a loss that no set-up model computed since the last backward(), so"
            f" strategy={strategy.name!r} would not synchronise its gradients: compute it by calling a"
            " model passed to setup() (model(x), not model.forward(x)), or name the method that computes it"
            " in setup(model, forward_methods=[...])."
        )
