"""NVIDIA GPUs for Lite: `accelerator="cuda"` (alias `"gpu"`) and `strategy="dp"`.

Lite finds these through entry points; importing `lite_cuda` loads nothing until a name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lite_cuda.__about__ import __version__

if TYPE_CHECKING:
    from lite_cuda.accelerator import CUDAAccelerator
    from lite_cuda.strategy import DataParallelStrategy

__all__ = ["CUDAAccelerator", "DataParallelStrategy", "__version__"]

_LAZY = {"CUDAAccelerator": "lite_cuda.accelerator", "DataParallelStrategy": "lite_cuda.strategy"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lite_cuda' has no attribute {name!r}")
