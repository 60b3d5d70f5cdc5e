"""Dense peak FLOP/s of TPU chips for `ThroughputMonitor`'s MFU, per matmul dtype.

Google's per-chip figures (TPUs have no structured-sparsity mode, so every figure is dense), in
TFLOP/s. TPUs publish no float32 matrix peak (float32 matmuls run as several bfloat16 passes), so
under `32-true` MFU is left out unless the user gives `peak_flops`. The generation is read from
`TPU_ACCELERATOR_TYPE` (e.g. `v5litepod-8`, `v5p-128`, `v6e-8`), which Cloud TPU VMs set.
"""

from __future__ import annotations

import os

_T = 1e12

#: (prefix of the accelerator type, {dtype: dense TFLOP/s per chip}), most specific first.
DENSE_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("v7", {"bf16": 2307.0, "fp8": 4614.0}),
    ("v6e", {"bf16": 918.0}),
    ("v5p", {"bf16": 459.0}),
    ("v5litepod", {"bf16": 197.0}),
    ("v5e", {"bf16": 197.0}),
    ("v4", {"bf16": 275.0}),
    ("v3", {"bf16": 123.0}),
    ("v2", {"bf16": 45.0}),
)


def dense_peak_flops(accelerator_type: str | None, dtype: str) -> float | None:
    """The dense peak FLOP/s of one chip of `accelerator_type` in `dtype`, or `None` if unknown."""
    if not accelerator_type:
        return None
    for prefix, figures in DENSE_TFLOPS:
        if accelerator_type.startswith(prefix):
            tflops = figures.get(dtype)
            return None if tflops is None else tflops * _T
    return None


def accelerator_type() -> str | None:
    """This TPU VM's accelerator type, from the environment Cloud TPU sets."""
    return os.environ.get("TPU_ACCELERATOR_TYPE")
