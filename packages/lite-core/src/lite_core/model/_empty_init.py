"""`init_module(empty_init=True)` under strategies that keep whole models: skip initialisation.

The parameters are allocated but their initial values are not computed (they hold whatever the
memory held), which saves the time of initialising a model whose weights are loaded right
afterwards; no random numbers are drawn for them. Buffers and plain tensors are computed as
usual: a causal mask or a constant written in `__init__` keeps its value, persistent or not.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.overrides import TorchFunctionMode

#: In-place functions through which `torch.nn.init` and modules' `reset_parameters` fill tensors.
#: (`torch.nn.init` functions dispatch to the mode themselves, under their own names.)
_FILLING = frozenset({
    "uniform_", "normal_", "trunc_normal_", "fill_", "zero_", "random_", "exponential_",
    "log_normal_", "cauchy_", "geometric_", "bernoulli_", "constant_", "ones_", "zeros_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_",
    "sparse_", "eye_", "dirac_",
})


class SkipInitialisation(TorchFunctionMode):
    """Inside this mode, filling a parameter in place does nothing and returns the parameter."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLING:
            # torch.nn.init passes the tensor by keyword, Tensor methods by position.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, nn.Parameter):
                return target
        return func(*args, **kwargs)
