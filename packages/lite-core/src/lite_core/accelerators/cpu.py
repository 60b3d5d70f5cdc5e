"""The CPU accelerator: each device is one process on this machine's CPUs."""

from __future__ import annotations

import os
from typing import Any

import torch

from lite_core.accelerators.accelerator import Accelerator
from lite_core.errors import ConfigurationError


class CPUAccelerator(Accelerator):
    """Runs on the CPU; `devices=N` starts N processes that talk over gloo."""

    name = "cpu"
    priority = 0
    distributed_backend = "gloo"
    autocast_device_type = "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        count = _cpu_process_count(devices)
        return list(range(count))

    def get_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def describe(self) -> str:
        return f"cpu ({os.cpu_count() or 1} CPU cores; devices=N starts N processes)"


def _cpu_process_count(devices: Any) -> int:
    if devices == "auto" or devices is None:
        return 1
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)) and devices:
        return len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    raise ConfigurationError(
        f"devices={devices!r} is not valid for the CPU accelerator: pass the number of processes"
        " to start, e.g. devices=2."
    )
