"""`accelerator="fake"`: a CPU in disguise that is available only when a test says so."""

from __future__ import annotations

import os
from typing import Any

import torch

from lite_core.plugins import Accelerator, CPUAccelerator


class FakeAccelerator(Accelerator):
    """Outranks the CPU for `accelerator="auto"` when `LITE_FAKE_AVAILABLE=1`; runs two precisions."""

    name = "fake"
    priority = 5
    supported_precisions = frozenset({"32-true", "bf16-true"})

    @staticmethod
    def is_available() -> bool:
        return os.environ.get("LITE_FAKE_AVAILABLE") == "1"

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return CPUAccelerator.parse_devices(devices)

    def get_device(self, index: int) -> torch.device:
        return torch.device("cpu")
