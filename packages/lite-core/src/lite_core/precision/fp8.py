"""FP8 training through torchao: the Linear layers' matmuls in float8 (and, if asked, a Mixture of
Experts' grouped matrix products), everything else in bf16."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

from lite_core.errors import ConfigurationError, MissingDependencyError
from lite_core.precision.precision import MixedPrecision
from lite_core._install import install_hint

#: torchao's recipe names (`Float8LinearConfig.from_recipe_name`) that Lite offers.
RECIPES = ("tensorwise", "rowwise")
#: The recipes of the experts' grouped matrix products (`experts=`), each with the hardware feature
#: it needs: torchao's FP8 rowwise `_scaled_grouped_mm` (compute capability 9.0: H100, H200) and
#: its MXFP8 grouped products (compute capability 10.0: B200).
EXPERT_RECIPES = {"rowwise": "fp8-grouped-mm", "mxfp8": "mxfp8"}

ModuleFilter = Callable[[nn.Module, str], bool]


class Float8Precision(MixedPrecision):
    """`precision="fp8-rowwise"` or `"fp8-tensorwise"`: torchao's float8 training.

    At `setup()` the model's `nn.Linear` layers that `module_filter_fn` selects become torchao
    `Float8Linear`s (still `nn.Linear`s, with the same parameters, names and state-dict keys), whose
    matmuls cast inputs, weights and gradients to float8 with dynamic scales. Everything else runs
    under bf16 autocast, as `bf16-mixed` (`autocast_dtype=None`: in the weights' dtype, no
    autocast); the weights stay in their dtype (float32), so checkpoints hold plain weights that
    load with or without FP8.

    The recipes are torchao's: `"tensorwise"` scales each tensor by its amax, `"rowwise"` each
    row. Under data parallelism a tensorwise scale is the amax of each process's own activations,
    so the result depends on how the global batch is split; rowwise scales do not (within float
    rounding). Pass `compile` options to `setup()` for speed, as torchao expects.

    Under a strategy that shards parameters with FSDP2 (`fsdp`), the tensorwise recipe all-gathers
    the weights in float8 (torchao's `enable_fsdp_float8_all_gather`): half the bytes of bf16, and
    the same numbers, since a tensorwise scale is the amax of the whole weight either way.

    Needs a GPU with FP8 (compute capability 8.9 or newer) and `pip install 'lite-core[fp8]'`.
    `emulate=True` computes the float8 casts in software on any device (CPU included): slow, and
    meant for tests and debugging.

    Args:
        recipe: `"rowwise"` or `"tensorwise"`.
        emulate: emulate FP8 instead of running it on FP8 hardware.
        module_filter_fn: `(module, fully_qualified_name) -> bool`, called for each `nn.Linear`:
            whether it becomes float8. Default: every Linear except the model's last one (its
            output head in the usual layout) and those whose `in_features` or `out_features` is
            not a multiple of 16 (FP8 matmuls need that).
        autocast_dtype: the dtype of the other operations (`torch.autocast`); `None` runs them in
            the weights' dtype, without autocast.
        device_type: the `torch.autocast` device type; `None` takes the accelerator's.
        fsdp_float8_all_gather: all-gather FSDP2's weights in float8. `None` (default): with the
            tensorwise recipe under `fsdp`; `True` also under `model_parallel` (for the
            `fully_shard` of your `parallelize_fn`); `False`: never.
        experts: also run a Mixture of Experts' grouped matrix products (`torch._grouped_mm` over
            stacked experts) in low precision, through torchao's MoE training: `"rowwise"` (FP8
            rowwise scales, a GPU of compute capability 9.0 or newer) or `"mxfp8"` (MXFP8, 10.0
            or newer: B200). The stacked parameters stay the user's `nn.Parameter`s (torchao wraps
            their data; checkpoints hold the plain weights). torchao has no emulation of these
            products: `emulate=True` does not cover them, and they are refused at construction on
            devices without them. `None` (default): the experts run in the autocast dtype.
        experts_filter_fn: `(module, fully_qualified_name) -> bool`: the modules whose parameters
            feed the grouped products. Default: every module with a parameter of three or more
            dimensions (stacked experts `[num_experts, ...]`, as `ExpertParallel` expects), except
            torch's own layers (a convolution).

    Raises:
        ConfigurationError: `recipe` is not one of `"rowwise"`, `"tensorwise"`; a float8
            all-gather with the rowwise recipe, or under a strategy that never uses `fully_shard`;
            `experts` is not one of `"rowwise"`, `"mxfp8"`, or the devices lack its grouped products.
        MissingDependencyError: `torchao` is not installed.
    """

    checked_by_name = True

    def __init__(self, recipe: str = "rowwise", emulate: bool = False, module_filter_fn: ModuleFilter | None = None,
                 autocast_dtype: torch.dtype | None = torch.bfloat16, device_type: str | None = None,
                 fsdp_float8_all_gather: bool | None = None, experts: str | None = None,
                 experts_filter_fn: ModuleFilter | None = None) -> None:
        if recipe not in RECIPES:
            raise ConfigurationError(f"Float8Precision(recipe={recipe!r}) is not a recipe: pass one of {list(RECIPES)}.")
        if experts is not None and experts not in EXPERT_RECIPES:
            raise ConfigurationError(
                f"Float8Precision(experts={experts!r}) is not a recipe of the experts' grouped products: pass one of"
                f" {list(EXPERT_RECIPES)}, or None."
            )
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ConfigurationError(
                f"Float8Precision(recipe={recipe!r}, fsdp_float8_all_gather=True) asks for torchao's float8 all-gather,"
                " which supports only the tensorwise recipe: pass recipe='tensorwise', or leave the all-gather off."
            )
        _require_torchao()
        if experts is not None:
            _require_torchao_moe_training()
        super().__init__(f"fp8-{recipe}", device_type or "cpu")
        self.experts = experts
        self._experts_filter_fn = experts_filter_fn
        if experts is not None:
            self.hardware_features = {EXPERT_RECIPES[experts]: f"Float8Precision(experts={experts!r})"}
        self._device_type_given = device_type is not None
        self.recipe = recipe
        self.emulated = emulate
        self._module_filter_fn = module_filter_fn
        self._autocast_dtype = autocast_dtype
        if autocast_dtype is not None:
            self._dtype = autocast_dtype
        self._fsdp_float8_all_gather = fsdp_float8_all_gather
        #: Whether `convert_module` turns torchao's float8 all-gather on (set by `connect_sharding`).
        self.all_gathers_in_float8 = False

    def connect(self, autocast_device_type: str) -> None:
        if not self._device_type_given:
            self._device_type = autocast_device_type

    def connect_sharding(self, fully_shards: bool | None) -> None:
        asked = self._fsdp_float8_all_gather
        if asked and fully_shards is False:
            raise ConfigurationError(
                "Float8Precision(fsdp_float8_all_gather=True) all-gathers FSDP2's weights, but this strategy never"
                " shards them with fully_shard: choose strategy='fsdp' or 'model_parallel', or leave the all-gather off."
            )
        self.all_gathers_in_float8 = bool(asked) if asked is not None else (
            fully_shards is True and self.recipe == "tensorwise")

    def forward_context(self) -> ContextManager[Any]:
        return nullcontext() if self._autocast_dtype is None else super().forward_context()

    def convert_output(self, data: Any) -> Any:
        return data if self._autocast_dtype is None else super().convert_output(data)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the selected `nn.Linear` layers for torchao's `Float8Linear` (in place)."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulated,
                                     enable_fsdp_float8_all_gather=self.all_gathers_in_float8)
        selects = self._module_filter_fn or default_module_filter(module)
        module = convert_to_float8_training(module, config=config, module_filter_fn=selects)
        if self.experts is not None:
            from torchao.quantization import quantize_

            quantize_(module, _experts_config(self.experts), filter_fn=self._experts_filter_fn or holds_stacked_experts)
        return module

    def __repr__(self) -> str:
        return (f"Float8Precision(recipe={self.recipe!r}, emulate={self.emulated!r},"
                f" fsdp_float8_all_gather={self.all_gathers_in_float8!r}, experts={self.experts!r})")


def default_module_filter(model: nn.Module) -> ModuleFilter:
    """Every `nn.Linear` of `model` except its last one and those with a dimension that is not a
    multiple of 16."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    head = linears[-1] if linears else None

    def selects(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name == head:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return selects


def holds_stacked_experts(module: nn.Module, name: str) -> bool:
    """Whether `module` holds stacked experts: a parameter of its own with three or more dimensions,
    in a module that is not one of torch's own layers (a convolution's weight has four)."""
    if type(module).__module__.startswith("torch.nn."):
        return False
    return any(param.dim() >= 3 for param in module.parameters(recurse=False))


def _experts_config(recipe: str) -> Any:
    """torchao's MoE training configuration of an `experts` recipe."""
    from torchao.prototype.moe_training.config import (
        Float8TrainingOpConfig,
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )

    if recipe == "mxfp8":
        return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
    return Float8TrainingOpConfig()


def _require_torchao_moe_training() -> None:
    try:
        import torchao.prototype.moe_training.config  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            "Float8Precision(experts=...) needs torchao's MoE training (torchao.prototype.moe_training, torchao 0.14"
            f" or newer), which this torchao lacks: run `{install_hint('fp8')}`."
        ) from error


def _require_torchao() -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            f"FP8 precision needs the torchao package, which is not installed: run `{install_hint('fp8')}`."
        ) from error
