"""QLoRA by hand, as a bitsandbytes user writes it without Lite: the tiny Llama of `_lora.py` with
peft's LoRA adapters, whose frozen `nn.Linear` layers (all but the head and the adapters) are
swapped for bitsandbytes' quantized layers. What `qlora_job.py` compares Lite's precision with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import _lora

#: The precision each test runs and the compute dtype of its 4-bit layers (`None`: the weights').
MODES = {"nf4": None, "nf4-dq": torch.bfloat16, "fp4": torch.bfloat16, "fp4-dq": None, "int8": None}


def quantize_by_hand(model: nn.Module, mode: str) -> nn.Module:
    """Replace the frozen base Linears of a peft model by bitsandbytes' layers, in place."""
    import bitsandbytes as bnb

    for name, layer in list(model.named_modules()):
        if type(layer) is not nn.Linear or name.endswith("lm_head") or "lora_" in name:
            continue
        if mode == "int8":
            new = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                      has_fp16_weights=False, threshold=6.0)
            new.weight = bnb.nn.Int8Params(layer.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            quant_type, double = mode.split("-")[0], mode.endswith("-dq")
            new = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                    compute_dtype=MODES[mode] or layer.weight.dtype, compress_statistics=double,
                                    quant_type=quant_type)
            new.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type=quant_type,
                                           compress_statistics=double)
        if layer.bias is not None:
            new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to("cpu"))
    return model


def qlora_model_by_hand(mode: str, quantize_first: bool = False) -> Any:
    """peft's LoRA on the base, quantized by hand after peft wrapped it, or (`quantize_first`) before."""
    if not quantize_first:
        return quantize_by_hand(_lora.lora_model(), mode)
    from peft import get_peft_model

    base = quantize_by_hand(_lora.base_model(), mode)
    torch.manual_seed(_lora.SEED + 1)
    return get_peft_model(base, _lora.lora_config())


def quantized_base(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen quantized weights of a state dict (uint8/int8 weights and their statistics)."""
    return {name: tensor for name, tensor in state.items() if "lora_" not in name
            and (not tensor.is_floating_point() or ".weight." in name or name.endswith("SCB"))}
