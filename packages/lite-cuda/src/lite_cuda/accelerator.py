"""`accelerator="cuda"` (alias `"gpu"`): NVIDIA GPUs, one process per GPU over NCCL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from lite_core.plugins import Accelerator, ConfigurationError, PrecisionSupport, precision_entry
from lite_cuda import _runtime
from lite_cuda._devices import parse_devices

_MATMUL_PRECISIONS = ("highest", "high", "medium")
#: bfloat16 arithmetic runs natively from compute capability 8.0 (Ampere) on.
_BF16_CAPABILITY = (8, 0)
#: FP8 matmuls run from compute capability 8.9 (Ada, e.g. L4) and 9.0 (Hopper) on.
_FP8_CAPABILITY = (8, 9)
#: The grouped matrix products of a Mixture of Experts' low-precision recipes (`hardware_features`
#: of a precision plugin): the compute capability each needs, GPUs that have it, and what to use
#: instead. torchao's FP8 rowwise `_scaled_grouped_mm` runs from Hopper on; MXFP8 from Blackwell.
_GROUPED_CAPABILITY = {
    "fp8-grouped-mm": ((9, 0), "FP8 grouped matrix products", "H100, H200",
                       "bf16 grouped products (leave experts out)"),
    "mxfp8": ((10, 0), "MXFP8 grouped matrix products", "B200, GB200",
              "experts='rowwise' (compute capability 9.0), or leave experts out"),
}


class CUDAAccelerator(Accelerator):
    """Runs on NVIDIA GPUs. `"auto"` picks it over the CPU whenever a GPU is visible.

    The parent process never initialises CUDA: GPUs are counted and checked through NVML, and
    each training process makes its own GPU current with `torch.cuda.set_device`.

    Args:
        matmul_precision: passed to `torch.set_float32_matmul_precision` in every process:
            `"high"` or `"medium"` let float32 matrix multiplications use TF32 on GPUs that
            have it, `"highest"` forbids it. `None` (default) leaves torch's setting alone.
    """

    name = "cuda"
    priority = 10
    distributed_backend = "nccl"
    default_distributed_strategy = "ddp"
    autocast_device_type = "cuda"
    #: Every precision, FP8 too (NVIDIA GPUs have FP8 units from compute capability 8.9: checked per
    #: GPU in validate_precision).
    precision_support = PrecisionSupport(hardware=frozenset({"fp8", *_GROUPED_CAPABILITY}))

    def __init__(self, matmul_precision: str | None = None) -> None:
        if matmul_precision is not None and matmul_precision not in _MATMUL_PRECISIONS:
            raise ConfigurationError(
                f"matmul_precision={matmul_precision!r} is not valid: pass one of {list(_MATMUL_PRECISIONS)}"
                " or None to keep torch's setting."
            )
        self.matmul_precision = matmul_precision
        #: A bf16 precision that could not be checked without initialising CUDA; checked per process.
        self._unchecked_bf16: str | None = None

    @staticmethod
    def is_available() -> bool:
        return _runtime.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if not _runtime.cuda_built():
            return f"torch {torch.__version__} is built without CUDA (install a CUDA build of torch for GPUs)"
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden is not None:
            return f"no GPU is visible with CUDA_VISIBLE_DEVICES={hidden!r}"
        return "no NVIDIA GPU is visible (torch.cuda.device_count() is 0: check the driver with nvidia-smi)"

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        visible = _runtime.device_count()
        if visible == 0:
            raise ConfigurationError(
                f"accelerator='cuda' needs a GPU but {CUDAAccelerator.unavailable_reason()}: use"
                " accelerator='auto' or 'cpu'."
            )
        return parse_devices(devices, visible)

    def get_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def setup_device(self, device: torch.device) -> None:
        _runtime.set_device(device)
        if self.matmul_precision is not None:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if self._unchecked_bf16 is not None and device.index is not None:
            _require_bf16(self._unchecked_bf16, device.index, _runtime.initialized_gpu(device.index))

    def validate_precision(self, precision: str, device_indexes: list[int]) -> None:
        """Refuse bf16 on a GPU older than Ampere and FP8 below compute capability 8.9; GPUs NVML
        cannot describe are checked per process."""
        self._unchecked_bf16 = None
        row = precision_entry(precision)
        if "fp8" in row.needs:
            for index in device_indexes:
                gpu = _runtime.gpu(index)
                if gpu is not None:
                    _require_fp8(precision, index, gpu)
            return
        if row.dtype != torch.bfloat16:
            return
        for index in device_indexes:
            gpu = _runtime.gpu(index)
            if gpu is None:
                self._unchecked_bf16 = precision
            else:
                _require_bf16(precision, index, gpu)

    def validate_hardware(self, features: Mapping[str, str], device_indexes: list[int]) -> None:
        """Refuse a grouped-product recipe (`Float8Precision(experts=...)`) on a GPU older than it
        needs (FP8 rowwise: compute capability 9.0; MXFP8: 10.0); GPUs NVML cannot describe pass."""
        super().validate_hardware(features, device_indexes)
        for feature, option in sorted(features.items()):
            if feature not in _GROUPED_CAPABILITY:
                continue  # declared for every GPU ("fp8" is checked by its precision's row)
            needed, what, examples, fix = _GROUPED_CAPABILITY[feature]
            for index in device_indexes:
                gpu = _runtime.gpu(index)
                if gpu is not None:
                    _require_capability(option, index, gpu, needed, what, examples, fix)

    def peak_flops(self, device: torch.device, dtype: str) -> float | None:
        """Dense data-sheet peak of this GPU (see `lite_cuda._peaks`), `None` for GPUs not listed."""
        from lite_cuda._peaks import dense_peak_flops

        return dense_peak_flops(_runtime.initialized_gpu(device.index or 0).name, dtype)

    def peak_memory(self, device: torch.device) -> int:
        """The CUDA caching allocator's peak of allocated memory on `device`."""
        return int(torch.cuda.max_memory_allocated(device))

    def describe(self) -> str:
        return f"cuda ({_runtime.device_count()} GPU(s) visible)"

    def __repr__(self) -> str:
        return f"CUDAAccelerator(matmul_precision={self.matmul_precision!r})"


def _require_bf16(precision: str, index: int, gpu: _runtime.GPU) -> None:
    _require_capability(f"precision={precision!r}", index, gpu, _BF16_CAPABILITY, "bfloat16", "A100, H100, RTX 30xx",
                        f"precision={precision.replace('bf16', '16')!r}")


def _require_fp8(precision: str, index: int, gpu: _runtime.GPU) -> None:
    _require_capability(f"precision={precision!r}", index, gpu, _FP8_CAPABILITY, "FP8", "L4, H100",
                        f"precision='bf16-mixed', or emulate FP8 for tests with"
                        f" precision=Float8Precision({precision.removeprefix('fp8-')!r}, emulate=True)")


def _require_capability(asked: str, index: int, gpu: _runtime.GPU, needed: tuple[int, int], feature: str,
                        examples: str, fix: str) -> None:
    """Refuse, naming what `asked` for it, GPU `index` if its compute capability is below `needed`."""
    if gpu.capability >= needed:
        return
    major, minor = gpu.capability
    raise ConfigurationError(
        f"{asked} needs a GPU with {feature} (compute capability {needed[0]}.{needed[1]} or newer,"
        f" e.g. {examples}) but GPU {index} is {gpu.name} ({major}.{minor}): use {fix}."
    )
