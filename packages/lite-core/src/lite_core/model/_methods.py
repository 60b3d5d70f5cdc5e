"""Methods of the user's module, called on the set-up model, run as its forward pass.

`model.generate(...)` or `model.training_step(x, y)` on the model `setup()` returned must run where
`model(x)` runs: under the precision and inside the strategy's forward (DDP's reducer, FSDP's
unsharding, DeepSpeed's engine). A strategy's wrapper runs its own work around one call of the
user's module (`DistributedDataParallel.forward` calls `self.module(...)`); making that one call
run the method instead routes the method through the wrapper, whatever the wrapper is.

A method called without a tensor among its arguments (`save_pretrained(folder)`,
`num_parameters()`, `resize_token_embeddings(n)`) computes nothing from an input: it runs on the
user's module as it is, so one rank alone may call it (under `if self.is_global_zero:`) without
waiting in the strategy's collectives (DDP's buffer broadcast and bucket rebuild, FSDP's
all-gather) for ranks that never come.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from torch import nn

from lite_core.move import holds_tensor
from lite_core.errors import MisuseError

_MISSING = object()


def computes_on_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a method call passes a tensor (in the containers a batch comes in, too: a
    tokenizer's `BatchEncoding`, a dataclass): such a call is a forward pass; one without is a
    utility call."""
    return holds_tensor((args, kwargs))


@contextmanager
def forward_runs(module: nn.Module, method: Callable[..., Any]) -> Iterator[None]:
    """Inside, the next call of `module`'s forward runs `method` instead.

    Only the next one: the method's own calls of the module (`self(...)` inside `generate`) reach
    the real `forward`. Leaving the block without that call having happened (a wrapper that does
    not call the user's module) raises, because the wrapper's output is not the method's.
    """
    saved = module.__dict__.get("forward", _MISSING)
    ran = False

    def restore() -> None:
        if saved is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = saved

    def forward_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal ran
        ran = True
        restore()
        return method(*args, **kwargs)

    module.__dict__["forward"] = forward_once
    try:
        yield
    finally:
        restore()
    if not ran:
        raise MisuseError(
            f"The strategy's wrapper did not call {type(module).__name__} in its forward, so"
            f" {getattr(method, '__name__', 'the method')}() could not run through it: compute it in"
            " the model's forward() instead (model(x) runs through the wrapper)."
        )


def call_through(wrapper: nn.Module, module: nn.Module, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    """`module.<name>(*args, **kwargs)` run as one forward pass of `wrapper`, the module a strategy
    built around `module` (e.g. `DistributedDataParallel(module)`): the arguments pass through the
    wrapper's forward as an input would, and the method's result comes back as its output."""
    with forward_runs(module, getattr(module, name)):
        return wrapper(*args, **kwargs)
