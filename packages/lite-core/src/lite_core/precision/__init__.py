"""Precision plugins."""

from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision

__all__ = ["MixedPrecision", "Precision", "TruePrecision"]
