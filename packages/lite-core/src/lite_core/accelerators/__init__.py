"""Accelerators: the kinds of device Lite runs on."""

from lite_core.accelerators.accelerator import Accelerator

__all__ = ["Accelerator"]
