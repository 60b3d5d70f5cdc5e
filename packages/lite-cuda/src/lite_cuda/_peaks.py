"""Dense peak FLOP/s of NVIDIA GPUs for `ThroughputMonitor`'s MFU, per matmul dtype.

Figures are NVIDIA's data-sheet numbers **without structured sparsity** (the data sheets print
the 2:4-sparse figure, twice the dense one, for tensor-core dtypes), per GPU, in TFLOP/s. A dtype a
GPU does not run on tensor cores (bf16 and tf32 before Ampere, fp8 before Hopper/Ada) is absent:
MFU is then left out rather than guessed. Names are matched against `torch.cuda.get_device_name()`,
first match wins (so the PCIe and NVL variants come before the SXM part of the same name).
"""

from __future__ import annotations

_T = 1e12

#: (substring of the device name, {dtype: dense TFLOP/s}), most specific first.
DENSE_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    ("H200 NVL", {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    ("H200", {"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    ("H100 NVL", {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    ("H100 PCIe", {"fp64": 26.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    ("H100", {"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    ("A100", {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A10G", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("V100-PCIE", {"fp64": 7.0, "fp32": 14.0, "fp16": 112.0}),
    ("V100", {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}),
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
)


def dense_peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of the GPU called `device_name` in `dtype`, or `None` if unknown."""
    for part, figures in DENSE_TFLOPS:
        if part in device_name:
            tflops = figures.get(dtype)
            return None if tflops is None else tflops * _T
    return None
