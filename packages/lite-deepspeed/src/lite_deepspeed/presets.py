"""Named presets: `strategy="deepspeed_stage_3"` and the like, each a `DeepSpeedStrategy`."""

from __future__ import annotations

from typing import Any

from lite_deepspeed.strategy import DeepSpeedStrategy


class DeepSpeedStage1(DeepSpeedStrategy):
    """`strategy="deepspeed_stage_1"`: optimizer state sharded."""

    name = "deepspeed_stage_1"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(stage=1, **kwargs)


class DeepSpeedStage2(DeepSpeedStrategy):
    """`strategy="deepspeed_stage_2"`: optimizer state and gradients sharded."""

    name = "deepspeed_stage_2"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(stage=2, **kwargs)


class DeepSpeedStage2Offload(DeepSpeedStrategy):
    """`strategy="deepspeed_stage_2_offload"`: stage 2 with optimizer state and step on the CPU."""

    name = "deepspeed_stage_2_offload"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(stage=2, offload_optimizer=True, **kwargs)


class DeepSpeedStage3(DeepSpeedStrategy):
    """`strategy="deepspeed_stage_3"`: parameters, gradients and optimizer state sharded."""

    name = "deepspeed_stage_3"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(stage=3, **kwargs)


class DeepSpeedStage3Offload(DeepSpeedStrategy):
    """`strategy="deepspeed_stage_3_offload"`: stage 3 with parameters and optimizer on the CPU."""

    name = "deepspeed_stage_3_offload"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(stage=3, offload_optimizer=True, offload_parameters=True, **kwargs)
