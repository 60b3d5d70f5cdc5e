"""Precision plugins: how modules, inputs, the forward pass and the backward pass are typed."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only


class Precision:
    """Full `32-true` precision: leaves everything as the user wrote it (bit-for-bit parity)."""

    name: str = "32-true"
    #: Whether `convert_input`, `forward_context` or `convert_output` do anything; when not,
    #: the wrapped model calls the user's forward directly (no per-step overhead).
    changes_forward: bool = False
    #: Whether `backward` does more than `tensor.backward()` (a gradient scaler); when not, and the
    #: strategy's `changes_backward` is `False` too, one process's `LightningLite.backward` calls
    #: `loss.backward()` directly. A precision that overrides `backward` declares it.
    changes_backward: bool = False
    #: Whether `optimizer_step` does more than `optimizer.step()`; when not, and the strategy
    #: steps optimizers plainly, a set-up optimizer's `step` is the user's own. A precision that
    #: overrides `optimizer_step` declares it.
    changes_optimizer_step: bool = False
    #: Whether the precision is computed in software (FP8 emulation): the accelerator's own support
    #: for it is then not needed.
    emulated: bool = False
    #: Whether the connector checks this plugin's `name` against what the strategy and accelerator
    #: support when the user passes it as an object (a custom plugin is trusted as it is).
    checked_by_name: bool = False
    #: Hardware features the plugin needs beyond its precision's row in the table, which no
    #: emulation covers, each with the option that asks for it (e.g. `{"fp8-grouped-mm":
    #: "Float8Precision(experts='rowwise')"}`); the accelerator checks them
    #: (`Accelerator.validate_hardware`) even when `emulated`.
    hardware_features: Mapping[str, str] = MappingProxyType({})

    def connect(self, autocast_device_type: str) -> None:
        """Called once the accelerator is known, with its `torch.autocast` device type."""

    def connect_sharding(self, fully_shards: bool | None) -> None:
        """Called once the strategy is known, with its `fully_shards_parameters` declaration
        (whether it shards parameters with FSDP2's `fully_shard`; `None`: the user decides)."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module's parameters and buffers to this precision."""
        return module

    def module_init_context(self) -> ContextManager[Any]:
        """Context in which modules are created directly in this precision."""
        return nullcontext()

    def empty_init_context(self) -> ContextManager[Any]:
        """Context added inside `init_module(empty_init=True)` (whose weights are loaded right
        after) where the strategy keeps whole models: a precision that changes what layers are
        (bitsandbytes' 4-bit ones) builds them in their final form there; nothing by default."""
        return nullcontext()

    def forward_context(self) -> ContextManager[Any]:
        """Context around the model's forward pass (autocast for mixed precision)."""
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        """Cast the floating-point tensors of a batch before the forward pass."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Cast the floating-point tensors the forward pass returned."""
        return data

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Run the backward pass from `tensor`."""
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step `optimizer`; returns what its `step` returns."""
        return optimizer.step(**kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients to their true scale before they are clipped or inspected."""

    @property
    def skips_nonfinite_steps(self) -> bool:
        """Whether an optimizer step with inf/NaN gradients is skipped (a gradient scaler's overflow)
        rather than an error: clipping then lets non-finite norms through without raising."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """State to save with a checkpoint (e.g. the gradient scaler's)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class TruePrecision(Precision):
    """`64-true`, `16-true` or `bf16-true`: parameters, inputs and computation in one dtype."""

    changes_forward = True

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self._dtype = dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self._dtype)

    def module_init_context(self) -> ContextManager[Any]:
        return _default_dtype(self._dtype)

    def forward_context(self) -> ContextManager[Any]:
        return _default_dtype(self._dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_floating(data, self._dtype)


class MixedPrecision(Precision):
    """`16-mixed` or `bf16-mixed`: float32 weights, forward under `torch.autocast`.

    `16-mixed` scales the loss with a `torch.amp.GradScaler` whose state is checkpointed. The
    scaler is built on first use, inside the process that trains: building a CUDA scaler asks
    `torch.cuda.is_available()`, which would initialise CUDA in a parent that later forks.

    The scale is updated once per iteration however many optimizers step, as in torch's AMP
    recipe: an optimizer step only marks an update as due, and it runs at the next `backward`
    (before the loss is scaled) or when the state is saved. So each optimizer's gradients are
    unscaled once, by the scale they were computed with.
    """

    changes_forward = True
    changes_backward = True  # the gradient scaler scales the loss (`16-mixed`)
    changes_optimizer_step = True  # and steps through the scaler

    def __init__(self, name: str, device_type: str, scaler: torch.amp.GradScaler | None = None) -> None:
        self.name = name
        self._device_type = device_type
        self._dtype = torch.float16 if name == "16-mixed" else torch.bfloat16
        self._scaler = scaler
        self._builds_scaler = scaler is None and name == "16-mixed"
        self._update_due = False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The gradient scaler (`16-mixed` only), built on first access."""
        if self._builds_scaler and self._scaler is None:
            self._scaler = _LazyUpdateScaler(self._device_type)
        return self._scaler

    def forward_context(self) -> ContextManager[Any]:
        return torch.autocast(self._device_type, dtype=self._dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        scaler = self.scaler
        if scaler is not None:
            self._update_scale()
            tensor = scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        scaler = self.scaler
        if scaler is None:
            return optimizer.step(**kwargs)
        if kwargs.get("closure") is not None:
            raise _closure_error()
        result = scaler.step(optimizer, **kwargs)
        self._update_due = True
        return result

    def _update_scale(self) -> None:
        """The scaler's `update()`, once for all the optimizer steps since the last one."""
        # A scaler Lite built knows whether the user already called `update()` themselves.
        due = getattr(self._scaler, "update_due", self._update_due)
        if due and self._scaler is not None:
            self._scaler.update()
        self._update_due = False

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @property
    def skips_nonfinite_steps(self) -> bool:
        return self.scaler is not None

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        self._update_scale()
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
            self._update_due = False


class _LazyUpdateScaler(torch.amp.GradScaler):
    """A `GradScaler` that knows whether an `update()` is due: an optimizer stepped since the last."""

    update_due = False

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        result = super().step(optimizer, *args, **kwargs)
        self.update_due = True
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        self.update_due = False


def _closure_error() -> Exception:
    from lite_core.errors import MisuseError

    return MisuseError(
        "precision='16-mixed' cannot step an optimizer with a closure (e.g. LBFGS) because the"
        " gradient scaler must see the gradients first: use precision='bf16-mixed' or '32-true'."
    )


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, data)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
