"""bitsandbytes' quantized layers built from a plain `nn.Linear`, and loaded back from their state dict."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import torch
from torch import nn


def linear_4bit(layer: nn.Linear, quant_type: str, compress_statistics: bool,
                compute_dtype: torch.dtype) -> nn.Module:
    """`layer` as a `bnb.nn.Linear4bit`, its weight quantized on the weight's device."""
    quantized = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=compress_statistics,
                                  quant_type=quant_type, device="meta")
    quantized.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type=quant_type,
                                         compress_statistics=compress_statistics, module=quantized)
    _keep_bias(quantized, layer)
    quantized = quantized.to(layer.weight.device)  # bitsandbytes quantizes as it moves the weight
    quantized._register_load_state_dict_pre_hook(_load_quantized_4bit, with_module=True)
    return quantized.train(layer.training)


def int8_linear(layer: nn.Linear) -> nn.Module:
    """`layer` as a `bnb.nn.Linear8bitLt` with int8 weights (LLM.int8(): outliers above 6 in 16 bits)."""
    quantized = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                    has_fp16_weights=False, threshold=6.0, device="meta")
    quantized.weight = bnb.nn.Int8Params(layer.weight.data, requires_grad=False, has_fp16_weights=False)
    _keep_bias(quantized, layer)
    return quantized.to(layer.weight.device).train(layer.training)


def _keep_bias(quantized: nn.Module, layer: nn.Linear) -> None:
    if layer.bias is not None:
        quantized.bias = nn.Parameter(layer.bias.data, requires_grad=layer.bias.requires_grad)


def _load_quantized_4bit(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Take a saved weight into the layer's own 4-bit weight: a 4-bit one with its quantization
    statistics (`weight.absmax`, ...), which `Linear4bit` writes in its state dict but does not
    read back; or a full-precision `[out, in]` one (the base's own checkpoint), quantized as it
    arrives, so that only one layer's full-precision weight is in memory at a time."""
    key = prefix + "weight"
    statistics = {name[len(key) + 1:]: state_dict.pop(name) for name in list(state_dict)
                  if name.startswith(key + ".")}
    if key not in state_dict:
        return
    weight = module.weight
    if statistics:
        loaded = bnb.nn.Params4bit.from_prequantized(state_dict[key], statistics, requires_grad=False,
                                                     device=weight.device, module=module)
    elif _full_precision(state_dict[key], module):
        loaded = bnb.nn.Params4bit(state_dict[key].detach(), requires_grad=False, quant_type=weight.quant_type,
                                   compress_statistics=weight.compress_statistics, blocksize=weight.blocksize,
                                   quant_storage=weight.quant_storage, module=module)
        loaded = loaded.to(weight.device)  # bitsandbytes quantizes as it moves the weight
    else:
        return
    weight.data, weight.quant_state = loaded.data, loaded.quant_state
    state_dict[key] = loaded.data  # the default load copies the same data


def _full_precision(tensor: Any, module: nn.Module) -> bool:
    """Whether `tensor` is a layer's plain weight: floating point, `[out_features, in_features]`."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            and tuple(tensor.shape) == (module.out_features, module.in_features))

