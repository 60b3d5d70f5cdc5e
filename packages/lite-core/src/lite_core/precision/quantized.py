"""Quantized frozen base weights on bitsandbytes (QLoRA): 4-bit NF4/FP4 or 8-bit `nn.Linear` layers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

from lite_core._install import install_hint
from lite_core.errors import ConfigurationError, MissingDependencyError
from lite_core.precision.precision import Precision

ModuleFilter = Callable[[nn.Module, str], bool]
#: bitsandbytes' modes, each a precision name of its own (rows of `lite_core.precision.names`).
MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")

#: The names of peft's adapter modules, which train and so stay in full precision.
_ADAPTER_NAMES = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "modules_to_save"})


class QuantizedPrecision(Precision):
    """`precision="nf4"`, `"nf4-dq"`, `"fp4"`, `"fp4-dq"` or `"int8"`: a frozen base in bitsandbytes' formats.

    At `setup()` the model's frozen `nn.Linear` layers that `module_filter_fn` selects become
    bitsandbytes layers holding their weights quantized: `Linear4bit` with the `"nf4"` or `"fp4"`
    data type (`-dq`: its block scales quantized again, bitsandbytes' `compress_statistics`), or
    `Linear8bitLt` (`"int8"`). Their weights no longer train; the other layers (the output head,
    embeddings, norms, peft's LoRA adapters) stay as the user built them and train as before. This
    is QLoRA's recipe: wrap the base with peft first, then set it up.

    The forward pass is the user's: a quantized layer computes in `compute_dtype` and returns its
    input's dtype. Checkpoints hold what the user saves: the adapters alone
    (`lite.trainable_state(model)`), or the whole model with its quantized weights, which load back
    into a model set up with the same precision.

    Needs `pip install 'lite-core[bnb]'` (bitsandbytes), and a strategy that keeps whole weights on
    each process (`single_device`, `ddp` and its variants): quantized weights cannot be sharded.

    Args:
        mode: `"nf4"`, `"nf4-dq"`, `"fp4"`, `"fp4-dq"` or `"int8"`.
        compute_dtype: the dtype of the 4-bit layers' matmuls (e.g. `torch.bfloat16`); `None`: the
            dtype of the weight each layer replaces. `"int8"` computes in its own way and ignores it.
        module_filter_fn: `(module, fully_qualified_name) -> bool`, called for each `nn.Linear`:
            whether it is quantized. Default: every `nn.Linear` whose weight does not train, except
            the model's last one (its output head in the usual layout) and peft's adapters
            (`lora_A`, `lora_B`, `modules_to_save`).

    Raises:
        ConfigurationError: `mode` is not one of the five.
        MissingDependencyError: `bitsandbytes` is not installed.
    """

    checked_by_name = True

    def __init__(self, mode: str = "nf4", compute_dtype: torch.dtype | None = None,
                 module_filter_fn: ModuleFilter | None = None) -> None:
        if mode not in MODES:
            raise ConfigurationError(f"QuantizedPrecision(mode={mode!r}) is not a mode: pass one of {sorted(MODES)}.")
        _require_bitsandbytes()
        self.name = mode
        self.compute_dtype = compute_dtype
        self._module_filter_fn = module_filter_fn

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replace the selected `nn.Linear` layers by bitsandbytes' quantized layers (in place)."""
        return replace_linears(module, self._module_filter_fn or default_module_filter(module), self._quantized)

    def empty_init_context(self) -> ContextManager[Any]:
        """Inside `init_module(empty_init=True)`, the 4-bit layers are built as such: the selected
        `nn.Linear` layers never hold full-precision memory (see `_built_quantized`), and the
        base's full-precision weights loaded afterwards (`load_state_dict`) are quantized one layer
        at a time as they arrive. The filter then sees the model as built, before any adapter or
        freezing: by default every `nn.Linear` but the model's last. `"int8"` layers are built
        in full precision and replaced at `setup`, as without `empty_init`."""
        if self.name == "int8":
            return nullcontext()
        from lite_core.precision._built_quantized import building_quantized

        return building_quantized(self._quantized, _all_but_the_last, self._module_filter_fn)

    def _quantized(self, layer: nn.Linear) -> nn.Module:
        from lite_core.precision import _bnb

        if self.name == "int8":
            return _bnb.int8_linear(layer)
        quant_type, _, double = self.name.partition("-")
        return _bnb.linear_4bit(layer, quant_type, compress_statistics=bool(double),
                                compute_dtype=self.compute_dtype or layer.weight.dtype)

    def __repr__(self) -> str:
        return f"QuantizedPrecision(mode={self.name!r}, compute_dtype={self.compute_dtype!r})"


def replace_linears(module: nn.Module, selects: ModuleFilter, quantized: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Put `quantized(layer)` in place of every `nn.Linear` of `module` that `selects`; returns `module`."""
    chosen = [(name, layer) for name, layer in module.named_modules() if type(layer) is nn.Linear and selects(layer, name)]
    for name, layer in chosen:
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, quantized(layer))
    return module


def default_module_filter(model: nn.Module) -> ModuleFilter:
    """Every frozen `nn.Linear` of `model` except its last one and peft's adapters."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    head = linears[-1] if linears else None

    def selects(module: nn.Module, name: str) -> bool:
        if name == head or _ADAPTER_NAMES.intersection(name.split(".")):
            return False
        return not any(p.requires_grad for p in module.parameters())

    return selects


def _all_but_the_last(model: nn.Module) -> ModuleFilter:
    """Every `nn.Linear` of a model as built except its last one (its output head in the usual
    layout) and peft's adapters: the default filter under `init_module(empty_init=True)`, where
    nothing is frozen yet."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    head = linears[-1] if linears else None
    return lambda module, name: name != head and not _ADAPTER_NAMES.intersection(name.split("."))


def _require_bitsandbytes() -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            "Quantized precision needs the bitsandbytes package, which is not installed:"
            f" run `{install_hint('bnb')}`."
        ) from error

