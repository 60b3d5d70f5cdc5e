"""Accelerators: the kinds of device Lite runs on."""

from __future__ import annotations

import importlib
from typing import Any

from lite_core.accelerators.accelerator import Accelerator

__all__ = ["Accelerator", "CPUAccelerator"]


def __getattr__(name: str) -> Any:
    if name == "CPUAccelerator":
        return importlib.import_module("lite_core.accelerators.cpu").CPUAccelerator
    raise AttributeError(f"module 'lite_core.accelerators' has no attribute {name!r}")
