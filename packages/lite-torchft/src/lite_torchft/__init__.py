"""Per-step fault tolerance for Lite on torchft: `LightningLite(strategy="ddp_ft")`.

Importing this package imports no torchft code; the strategy loads it when it is connected.
"""

from __future__ import annotations

from typing import Any

from lite_torchft.__about__ import __version__

__all__ = ["Algorithm", "AlgorithmFSDPStrategy", "AlgorithmStrategy", "DDPFTStrategy", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "DDPFTStrategy":
        from lite_torchft.strategy import DDPFTStrategy

        return DDPFTStrategy
    if name in ("Algorithm", "AlgorithmStrategy", "AlgorithmFSDPStrategy"):  # the fault-tolerance algorithm interface
        import lite_torchft.algorithm

        return getattr(lite_torchft.algorithm, name)
    raise AttributeError(f"module 'lite_torchft' has no attribute {name!r}")
