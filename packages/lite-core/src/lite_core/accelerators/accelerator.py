"""The accelerator: which devices a process can use and how to prepare them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from lite_core.errors import ConfigurationError
from lite_core.precision.names import PrecisionSupport, SupportedPrecisions

if TYPE_CHECKING:
    import torch


class Accelerator(ABC):
    """A kind of device. Subclasses declare what they support; the connector reads it.

    Backends register subclasses under the `lite_core.accelerators` entry-point group.
    """

    #: The name users pass as `accelerator=...` (aliases are further entry-point names).
    name: ClassVar[str]
    #: Highest available priority wins when the user asks for `accelerator="auto"`.
    priority: ClassVar[int] = 0
    #: The `torch.distributed` backend of process groups on this device (e.g. "gloo", "nccl"), or
    #: `None` when the device runs no `torch.distributed` process group. Strategies that need one
    #: (`ddp`, `fsdp`, ...) read this instead of naming accelerators.
    distributed_backend: ClassVar[str | None] = "gloo"
    #: Strategy chosen for `strategy="auto"` when the job has more than one process.
    default_distributed_strategy: ClassVar[str] = "ddp"
    #: Strategy chosen for `strategy="auto"` when the job has more than one process but this
    #: process cannot be run again to start them (a REPL, a notebook, code piped to `python -`).
    default_interactive_strategy: ClassVar[str] = "ddp_fork"
    #: Strategy chosen for `strategy="auto"` when the job has one process (a device such as
    #: XLA's needs its own, which cuts the graph at each step).
    default_single_device_strategy: ClassVar[str] = "single_device"
    #: What this device runs: every family and dtype, but no FP8 unless a device declares its
    #: FP8 matrix units (`hardware={"fp8"}`).
    precision_support: ClassVar[PrecisionSupport] = PrecisionSupport(hardware=frozenset())
    #: The names of the precisions `precision_support` accepts (read from the precision table).
    supported_precisions: ClassVar[frozenset[str]] = SupportedPrecisions()  # type: ignore[assignment]
    #: Device type passed to `torch.autocast`.
    autocast_device_type: ClassVar[str] = "cpu"

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this machine has at least one such device."""

    @staticmethod
    @abstractmethod
    def parse_devices(devices: Any) -> list[int]:
        """Turn the user's `devices` argument into device indexes (one process each)."""

    @abstractmethod
    def get_device(self, index: int) -> torch.device:
        """The `torch.device` a process with this device index computes on."""

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why `is_available()` is false, as the middle of an error sentence (e.g. what the
        machine has instead); named accelerators that are not available fail with it."""
        return "this machine has no such device"

    def validate_precision(self, precision: str, device_indexes: list[int]) -> None:
        """Raise a `ConfigurationError` if `precision` cannot run on these devices (e.g. bf16 on
        a GPU without it); called at construction, after the precision was resolved."""

    def validate_hardware(self, features: Mapping[str, str], device_indexes: list[int]) -> None:
        """Raise a `ConfigurationError` if these devices lack a feature of `features` (a precision
        plugin's `hardware_features`: each feature with the option that needs it). By default, a
        feature that `precision_support.hardware` does not declare; a device whose generations
        differ (a GPU's compute capability) also checks each device."""
        declared = self.precision_support.hardware
        for feature, option in sorted(features.items()):
            if declared is not None and feature not in declared:
                raise ConfigurationError(
                    f"{option} needs {feature} hardware, which accelerator={self.name!r} does not have: choose an"
                    " accelerator whose devices have it, or leave that option out."
                )

    def setup_device(self, device: torch.device) -> None:
        """Prepare `device` for the current process (e.g. make it the current CUDA device)."""

    def teardown(self) -> None:
        """Release what `setup_device` took."""

    def peak_flops(self, device: torch.device, dtype: str) -> float | None:
        """The dense (no structured sparsity) peak FLOP/s of `device` for matrix multiplications in
        `dtype` (`"fp64"`, `"fp32"`, `"tf32"`, `"bf16"`, `"fp16"` or `"fp8"`), or `None` when
        it is not known; `ThroughputMonitor` divides by it for MFU and leaves MFU out for `None`."""
        return None

    def peak_memory(self, device: torch.device) -> int:
        """The most memory (bytes) this process has held on `device` so far: the device
        allocator's peak where there is one; by default the process's peak resident set size."""
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux

    def describe(self) -> str:
        """One line for `lite env` and error messages."""
        return f"{self.name} (available: {self.is_available()})"
