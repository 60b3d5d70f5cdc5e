"""lite-cuda is found through entry points, declares the core it needs and imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import distribution

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from lite_core._registry import ACCELERATORS, STRATEGIES
from lite_cuda import CUDAAccelerator, DataParallelStrategy


def test_entry_points_register_cuda_gpu_and_dp() -> None:
    assert ACCELERATORS.load("cuda") is CUDAAccelerator
    assert ACCELERATORS.load("gpu") is CUDAAccelerator
    assert STRATEGIES.load("dp") is DataParallelStrategy


def test_the_distribution_declares_the_core_versions_it_supports() -> None:
    requires = [Requirement(line) for line in distribution("lite-cuda").requires or []]
    assert [r.specifier for r in requires if r.name == "lite-core"] == [SpecifierSet(">=0.1,<0.2")]


def test_importing_lite_cuda_loads_neither_the_accelerator_nor_the_strategy() -> None:
    code = ("import sys, lite_cuda; print(sorted(m for m in sys.modules if m.startswith('lite_cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['lite_cuda.__about__']"
