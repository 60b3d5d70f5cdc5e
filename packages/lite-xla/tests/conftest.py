"""Fixtures for lite-xla's tests, which run for real on XLA's CPU device (`PJRT_DEVICE=CPU`).

The subprocess fixtures (`run_script`, `start_script`, `output_of`) come from the repository's
`conftest.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(autouse=True)
def _xla_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs XLA on the CPU, one device unless the test asks for more."""
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)


def pytest_configure(config: pytest.Config) -> None:
    """Start the XLA runtime when this conftest loads (at collection, before any test of any folder
    runs in this process): PyTorch's autograd engine sizes its per-device queues at the first
    backward pass, and an XLA device it did not count then fails later with an internal assert
    (a torch/torch-xla limitation). A session fixture started it too late when a worker's first
    tests were the matrix's, whose plain-PyTorch reference runs a CPU backward in this process.
    Tests that must start with no runtime run in a subprocess."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    torch_xla.device()
