"""Precision plugins."""

from lite_core.precision.fp8 import Float8Precision
from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision
from lite_core.precision.nf4 import TorchaoNF4Precision
from lite_core.precision.quantized import QuantizedPrecision

__all__ = ["Float8Precision", "MixedPrecision", "Precision", "QuantizedPrecision", "TorchaoNF4Precision", "TruePrecision"]
