"""The dense peak FLOP/s table behind MFU: dense figures (half the data sheets' sparse ones),
the most specific name first, and nothing for a GPU or dtype it does not know."""

from __future__ import annotations

import pytest
import torch

from lite_cuda import CUDAAccelerator, _runtime
from lite_cuda._peaks import dense_peak_flops


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),       # data sheet: 624 with sparsity
    ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),       # SXM; data sheet: 1979 with sparsity
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA L4", "fp16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7),
])
def test_dense_peaks(name: str, dtype: str, tflops: float) -> None:
    assert dense_peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_gpus_and_dtypes_have_no_peak() -> None:
    assert dense_peak_flops("NVIDIA GeForce GTX 1080", "fp32") is None
    assert dense_peak_flops("NVIDIA A100-SXM4-40GB", "fp8") is None  # Ampere has no fp8 tensor cores
    assert dense_peak_flops("Tesla T4", "bf16") is None


def test_the_accelerator_reads_its_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "initialized_gpu", lambda index: _runtime.GPU("NVIDIA H100 PCIe", (9, 0)))
    assert CUDAAccelerator().peak_flops(torch.device("cuda", 0), "tf32") == pytest.approx(378e12)
