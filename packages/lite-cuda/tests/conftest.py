"""Fixtures for lite-cuda's tests.

CPU machines (CI) replace `lite_cuda._runtime`, the one module that asks the machine about GPUs,
with a fake that reports the GPUs a test wants; everything above it runs for real. Tests that
need a real GPU carry `@pytest.mark.cuda` and are skipped, with the reason, on machines without.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lite_core import _registry
from lite_cuda import _runtime

@pytest.fixture(autouse=True)
def _plain_local_process(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variables (the repository's `clean_env`), no GPU selection, fresh entry points."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    _registry.clear_cache()


class FakeGPUs:
    """What the faked runtime reports and what it was asked to do."""

    def __init__(self, count: int, gpu: _runtime.GPU | None) -> None:
        self.count = count
        self.gpu = gpu
        self.current: list[torch.device] = []


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeGPUs]:
    """`fake_gpus(count, name=..., capability=(8, 0), described=True)` -> the faked runtime.

    `described=False` makes NVML unable to describe the GPUs (so checks move to the worker).
    """

    def install(count: int, name: str = "NVIDIA A100-SXM4-80GB", capability: tuple[int, int] = (8, 0),
                described: bool = True) -> FakeGPUs:
        gpu = _runtime.GPU(name, capability)
        fake = FakeGPUs(count, gpu if described else None)
        monkeypatch.setattr(_runtime, "cuda_built", lambda: True)
        monkeypatch.setattr(_runtime, "device_count", lambda: fake.count)
        monkeypatch.setattr(_runtime, "gpu", lambda index: fake.gpu if index < fake.count else None)
        monkeypatch.setattr(_runtime, "initialized_gpu", lambda index: gpu)
        monkeypatch.setattr(_runtime, "set_device", fake.current.append)
        return fake

    return install
