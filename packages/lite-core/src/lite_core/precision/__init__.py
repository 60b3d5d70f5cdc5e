"""Precision plugins."""

from lite_core.precision.fp8 import Float8Precision
from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision

__all__ = ["Float8Precision", "MixedPrecision", "Precision", "TruePrecision"]
