"""DeepSpeed ZeRO for Lite: `LightningLite(strategy="deepspeed_stage_3", devices=2)`.

Importing this package imports no DeepSpeed code; the strategy loads it when it is connected.
"""

from __future__ import annotations

from typing import Any

from lite_deepspeed.__about__ import __version__

__all__ = ["DeepSpeedPrecision", "DeepSpeedStrategy", "__version__", "convert_to_fp32_state_dict"]


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedStrategy":
        from lite_deepspeed.strategy import DeepSpeedStrategy

        return DeepSpeedStrategy
    if name == "DeepSpeedPrecision":
        from lite_deepspeed.precision import DeepSpeedPrecision

        return DeepSpeedPrecision
    if name == "convert_to_fp32_state_dict":
        from lite_deepspeed.convert import convert_to_fp32_state_dict

        return convert_to_fp32_state_dict
    raise AttributeError(f"module 'lite_deepspeed' has no attribute {name!r}")
