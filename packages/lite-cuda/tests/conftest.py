"""Fixtures for lite-cuda's tests.

CPU machines (CI) replace `lite_cuda._runtime`, the one module that asks the machine about GPUs,
with a fake that reports the GPUs a test wants; everything above it runs for real. Tests that
need a real GPU carry `@pytest.mark.cuda` and are skipped, with the reason, on machines without.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lite_core import _registry
from lite_cuda import _runtime

_ROOT = Path(__file__).resolve().parents[3]

# The subprocess helpers of the repository's integration tests (run_script, output_of, ...).
_spec = importlib.util.spec_from_file_location("_lite_integration_conftest", _ROOT / "tests/conftest.py")
assert _spec is not None and _spec.loader is not None
_integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_integration)
run_script = _integration.run_script
output_of = _integration.output_of

_ENV_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "KUBERNETES_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
              "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LITE_FAKE_AVAILABLE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as a plain local process (the host may be inside a scheduler) with fresh entry points."""
    for name in list(os.environ):
        if name in _ENV_NAMES or name.startswith(_ENV_PREFIXES):
            monkeypatch.delenv(name)
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
