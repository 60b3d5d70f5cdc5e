"""torchao's NF4 frozen base weights, which FSDP2 shards: QLoRA under `fsdp` and `model_parallel`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lite_core._install import install_hint
from lite_core.errors import CheckpointError, MisuseError, MissingDependencyError
from lite_core.precision.precision import Precision
from lite_core.precision.quantized import ModuleFilter, default_module_filter, replace_linears


class TorchaoNF4Precision(Precision):
    """`precision="nf4-torchao"`: the frozen base's `nn.Linear` weights in torchao's NF4.

    At `setup()`, before the strategy shards the model, the frozen `nn.Linear` layers that
    `module_filter_fn` selects (the same default as `QuantizedPrecision`: every frozen one but the
    model's last, never peft's adapters) hold their weight as torchao's `NF4Tensor` (4-bit
    NormalFloat in blocks of `block_size` weights, the blocks' scales quantized again in blocks of
    `scaler_block_size`) and compute `linear_nf4(x, weight)`: the weight dequantized to the input's
    dtype, then a matmul. `NF4Tensor` implements FSDP2's all-gather extension, so `fully_shard`
    shards the packed weight along its rows and gathers it in 4 bits: each process holds 1/N of the
    4-bit base. A weight's row count on each process must divide into whole blocks and scale blocks.

    Checkpoints hold plain tensors: the layer writes its weight dequantized (in the dtype it was
    quantized from) and quantizes what it loads (a sharded weight whole, then cut as FSDP2 cut it),
    so a whole checkpoint loads under any strategy and precision; loaded back, its block scales are
    quantized again, so the base is NF4 of the dequantized weight, not the first NF4 bit for bit.
    The adapters-only checkpoint (`trainable_state(model)`) holds no base at all: the exact route.

    Needs torchao (`pip install 'lite-core[fp8]'` installs it) and a strategy that shards with FSDP2
    or keeps the model on one process (`fsdp`, `model_parallel`, `single_device`). Under `ddp` use
    `precision="nf4"` (bitsandbytes): DDP's broadcast of the parameters at setup overwrites an
    `NF4Tensor`'s statistics.

    Args:
        block_size: weights per quantization block (torchao's default, 64).
        scaler_block_size: block scales per block of their own quantization (torchao's default, 256).
        module_filter_fn: `(module, fully_qualified_name) -> bool` for each `nn.Linear`.
    """

    checked_by_name = True
    name = "nf4-torchao"

    def __init__(self, block_size: int = 64, scaler_block_size: int = 256,
                 module_filter_fn: ModuleFilter | None = None) -> None:
        _require_torchao()
        self.block_size = block_size
        self.scaler_block_size = scaler_block_size
        self._module_filter_fn = module_filter_fn

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Give the selected `nn.Linear` layers NF4 weights (in place)."""
        return replace_linears(module, self._module_filter_fn or default_module_filter(module), self._quantized)

    def _quantized(self, layer: nn.Linear) -> nn.Module:
        if layer.weight.is_meta:
            raise MisuseError(
                "precision='nf4-torchao' quantizes the base's weights at setup, and this model's are on the meta"
                " device (init_module(empty_init=True) under a sharding strategy): build the model with"
                " empty_init=False and load its weights before setup.")
        return NF4Linear(layer, self.block_size, self.scaler_block_size)

    def __repr__(self) -> str:
        return f"TorchaoNF4Precision(block_size={self.block_size}, scaler_block_size={self.scaler_block_size})"


class NF4Linear(nn.Module):
    """An `nn.Linear` whose frozen weight is torchao's `NF4Tensor` (see `TorchaoNF4Precision`)."""

    def __init__(self, layer: nn.Linear, block_size: int, scaler_block_size: int) -> None:
        from torchao.quantization import to_nf4

        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = nn.Parameter(to_nf4(layer.weight.detach(), block_size, scaler_block_size), requires_grad=False)
        self.bias = layer.bias
        self.train(layer.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = _dequantized(self.weight)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Quantize a plain saved weight (whole, or a `DTensor` shard laid out as this one) into the
        NF4 weight in place: FSDP2 keeps the parameter object it registered."""
        key = prefix + "weight"
        if key not in state_dict:
            super()._load_from_state_dict(state_dict, prefix, *args)
            return
        incoming = state_dict[key]
        others = {name: value for name, value in state_dict.items() if name != key}
        super()._load_from_state_dict(others, prefix, *args)
        missing_keys = args[2]
        if key in missing_keys:
            missing_keys.remove(key)
        _quantize_into(self.weight, incoming)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The plain weight an NF4 weight stands for (a sharded one's shard, as a `DTensor` of the same layout)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        local = weight.to_local().get_original_weight()
        return DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                                  stride=weight.stride())
    return weight.get_original_weight()


def _quantize_into(weight: torch.Tensor, incoming: torch.Tensor) -> None:
    """Put `incoming` (a plain weight: whole, or a `DTensor` laid out as `weight`) into the NF4
    `weight` in place. A sharded weight is quantized whole (one layer at a time) and then cut as
    FSDP2 cut it: the shards of one NF4 weight share its statistics (the mean of its scales), which
    shards quantized each on its own would not."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization import to_nf4

    sharded = isinstance(weight, DTensor)
    own = weight.to_local() if sharded else weight
    given = incoming.to_local() if isinstance(incoming, DTensor) else incoming
    if isinstance(given, type(own)):  # NF4 already (torch's loader hands a weight it does not load back)
        if given is not own:
            _copy_inner(own, given)
        return
    whole = incoming.full_tensor() if isinstance(incoming, DTensor) else incoming
    if tuple(whole.shape) != tuple(weight.shape):
        raise CheckpointError(f"A saved weight of shape {tuple(whole.shape)} cannot load into an NF4 weight of shape"
                              f" {tuple(weight.shape)}: load the checkpoint into the model it was saved from.")
    new = to_nf4(whole.detach().to(own.device), own.block_size, own.scaler_block_size)
    if sharded:
        new = new.split(own.shape[0])[_row_block(weight)]
    _copy_inner(own, new)


def _copy_inner(own: Any, new: Any) -> None:
    """Copy the NF4 tensor `new`'s packed data and statistics into `own`, which keeps its identity."""
    with torch.no_grad():
        for name in own.__tensor_flatten__()[0]:
            getattr(own, name).copy_(getattr(new, name))


def _row_block(weight: Any) -> int:
    """Which block of rows this process's shard of a row-sharded `DTensor` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return offset[0] // local_shape[0] if local_shape[0] else 0


def _require_torchao() -> None:
    try:
        import torchao  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            f"precision='nf4-torchao' needs the torchao package, which is not installed: run `{install_hint('fp8')}`."
        ) from error
