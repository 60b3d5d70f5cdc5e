"""`model(x, target=y)`: the set-up model computes the loss with the `loss_fn` given to `setup`.

Under pipeline parallelism the schedule needs the loss function and the target inside the forward
pass (it runs forward and backward together). Giving `setup(model, optimizer, loss_fn=...)` to
every strategy lets one loop, `loss = model(x, target=y)` then `backward(loss)`, run unchanged
with and without a pipeline; without one, the loss is `loss_fn(model(x), y)` as the user would
write it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class ForwardWithLoss:
    """Calls `forward(*args, **kwargs)`; with a `target=` keyword, returns `loss_fn(output, target)`."""

    def __init__(self, forward: Callable[..., Any], loss_fn: Callable[..., torch.Tensor]) -> None:
        self._forward = forward
        self.loss_fn = loss_fn

    def __call__(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        output = self._forward(*args, **kwargs)
        return output if target is None else self.loss_fn(output, target)
