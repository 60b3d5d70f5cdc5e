"""The core's precision plugin for each precision name."""

from __future__ import annotations

import torch

from lite_core.precision.fp8 import Float8Precision
from lite_core.precision.names import FP8_PRECISIONS, QUANTIZED_PRECISIONS, SHARDED_QUANTIZED_PRECISIONS
from lite_core.precision.nf4 import TorchaoNF4Precision
from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision
from lite_core.precision.quantized import QuantizedPrecision

_TRUE_DTYPES = {"64-true": torch.float64, "16-true": torch.float16, "bf16-true": torch.bfloat16}


def build_precision(name: str, device_type: str) -> Precision:
    """The core's precision plugin for a normalised precision `name` on `device_type`."""
    if name in FP8_PRECISIONS:
        return Float8Precision(name.removeprefix("fp8-"), device_type=device_type)
    if name in QUANTIZED_PRECISIONS:
        return QuantizedPrecision(name)
    if name in SHARDED_QUANTIZED_PRECISIONS:
        return TorchaoNF4Precision()
    if name in _TRUE_DTYPES:
        return TruePrecision(name, _TRUE_DTYPES[name])
    if name.endswith("-mixed"):
        return MixedPrecision(name, device_type)
    return Precision()
