"""Which methods of the user's module, called on the set-up model, run as its forward pass.

A method is a forward pass only when it is one: `generate` (Hugging Face's, peft's, the user's own)
and the methods the user names in `setup(model, forward_methods=[...])`. Such a call must run
where `model(x)` runs: under the precision and inside the strategy's forward (DDP's reducer, FSDP's
unsharding, DeepSpeed's engine), so every rank calls it, as every rank calls `model(x)`. A
strategy's wrapper runs its own work around one call of the user's module
(`DistributedDataParallel.forward` calls `self.module(...)`); making that one call run the method
instead routes the method through the wrapper, whatever the wrapper is.

Every other method (`save_pretrained(folder, state_dict=full)`, `num_parameters()`,
`get_input_embeddings()`, a `training_step` that calls `self(x)`) runs on the user's module as it
is, whatever its arguments: a tensor among them does not make it a forward pass. One rank alone
may call it (under `if self.is_global_zero:`) without entering the strategy's collectives (DDP's
buffer broadcast and bucket rebuild, FSDP's all-gather) that the other ranks never join. Where such
a method calls the model (`self(x)`), that call is `model(x)` and runs through the strategy.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from torch import nn

from lite_core.errors import MisuseError

_MISSING = object()

#: The methods that run as a forward pass without being named: the user's, Hugging Face's and
#: peft's `generate` (its own calls of the model must not each be a pass of the strategy: ranks
#: whose sequences end at different lengths would call DDP's forward a different number of times).
FORWARD_METHODS = ("generate",)


def forward_methods(user_class: type[nn.Module], named: tuple[str, ...]) -> dict[str, Callable[..., Any]]:
    """The methods of `user_class` that run as a forward pass: `FORWARD_METHODS` where the class
    has them, and every name in `named` (from `setup(forward_methods=...)`), which it must have."""
    methods = _methods_of(user_class)
    for name in named:
        if name not in methods:
            raise MisuseError(
                f"setup(forward_methods=...) names {name!r}, which is not a method of"
                f" {user_class.__name__} outside torch.nn.Module: name methods that your model's class"
                " defines (model(x) already runs forward through the strategy)."
            )
    return {name: methods[name] for name in (*FORWARD_METHODS, *named) if name in methods}


def _methods_of(user_class: type[nn.Module]) -> dict[str, Callable[..., Any]]:
    """The plain functions defined by `user_class` and its bases outside torch (a Hugging Face
    `generate` included) under names that are not `nn.Module`'s own."""
    methods: dict[str, Callable[..., Any]] = {}
    for klass in reversed(user_class.__mro__):
        if klass.__module__.split(".")[0] == "torch" or klass is object:
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or hasattr(nn.Module, name):
                continue
            if inspect.isfunction(value):
                methods[name] = value
            else:
                methods.pop(name, None)  # a property or attribute of a subclass hides the base's method
    return methods


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
