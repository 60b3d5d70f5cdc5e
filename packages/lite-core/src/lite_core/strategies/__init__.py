"""Strategies: how work is spread over processes.

The concrete classes load on first access, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from lite_core.strategies.strategy import Strategy

_LAZY = {
    "SingleDeviceStrategy": "lite_core.strategies.single_device",
    "DDPStrategy": "lite_core.strategies.ddp",
    "DDPSpawnStrategy": "lite_core.strategies.ddp",
    "DDPForkStrategy": "lite_core.strategies.ddp",
    "FSDPStrategy": "lite_core.strategies.fsdp",
    "ModelParallelStrategy": "lite_core.strategies.model_parallel",
    "DDPShardedStrategy": "lite_core.strategies.ddp_sharded",
    "DDPShardedSpawnStrategy": "lite_core.strategies.ddp_sharded",
}

__all__ = ["Strategy", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lite_core.strategies' has no attribute {name!r}")
