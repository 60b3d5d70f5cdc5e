"""Reading GPU facts through NVML: CUDA_VISIBLE_DEVICES mapping, ordering, and every failure -> None.

NVML cannot exist on a CPU machine, so these tests load a fake library in its place; a GPU test
(`test_gpu.py`) compares the real library's answers with torch's.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from lite_cuda import _nvml


@pytest.mark.parametrize(
    ("visible", "total", "physical"),
    [
        (None, 3, [0, 1, 2]),
        ("", 3, []),
        ("2,0", 3, [2, 0]),
        (" 1 , 2", 3, [1, 2]),
        ("1,7,0", 4, [1]),  # CUDA stops at the first index that does not exist
        ("1,x,0", 4, [1]),
        ("-1", 4, []),
        ("GPU-8f6e2a", 4, None),  # UUIDs cannot be mapped without asking NVML for them
        ("MIG-1234", 4, None),
        ("0,0", 4, None),
    ],
)
def test_cuda_visible_devices_maps_cuda_indexes_to_nvml_indexes(visible: str | None, total: int,
                                                                 physical: list[int] | None) -> None:
    assert _nvml.physical_indexes(visible, total) == physical


class FakeNVML:
    """Just the NVML calls Lite makes, over a list of (name, major, minor)."""

    def __init__(self, gpus: list[tuple[str, int, int]], init_status: int = 0) -> None:
        self.gpus = gpus
        self.init_status = init_status
        self.open_sessions = 0

    def nvmlInit_v2(self) -> int:
        self.open_sessions += self.init_status == 0
        return self.init_status

    def nvmlShutdown(self) -> int:
        self.open_sessions -= 1
        return 0

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: ctypes.c_uint, handle: Any) -> int:
        if index.value >= len(self.gpus):
            return 2
        handle._obj.value = 1000 + index.value
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle: ctypes.c_void_p, major: Any, minor: Any) -> int:
        _, major._obj.value, minor._obj.value = self.gpus[handle.value - 1000]
        return 0

    def nvmlDeviceGetName(self, handle: ctypes.c_void_p, name: Any, length: ctypes.c_uint) -> int:
        name.value = self.gpus[handle.value - 1000][0].encode()[: length.value - 1]
        return 0


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(gpus: list[tuple[str, int, int]], init_status: int = 0) -> FakeNVML:
        fake = FakeNVML(gpus, init_status)
        monkeypatch.setattr(_nvml.ctypes, "CDLL", lambda name: fake if name == "libnvidia-ml.so.1" else None)
        return fake

    return install


_MIXED = [("NVIDIA A100", 8, 0), ("Tesla V100", 7, 0), ("NVIDIA H100", 9, 0)]


def test_a_visible_index_reads_the_gpu_cuda_means(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = nvml(_MIXED)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert _nvml.visible_gpu(1) == ("Tesla V100", 7, 0)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert _nvml.visible_gpu(0) == ("NVIDIA H100", 9, 0)
    assert _nvml.visible_gpu(1) == ("Tesla V100", 7, 0)
    assert _nvml.visible_gpu(2) is None
    assert fake.open_sessions == 0


def test_mixed_gpus_in_cudas_default_order_cannot_be_mapped(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml(_MIXED)
    assert _nvml.visible_gpu(0) is None  # CUDA puts the fastest first, NVML orders by bus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _nvml.visible_gpu(0) == ("NVIDIA A100", 8, 0)  # one visible GPU: nothing to reorder
    nvml([("NVIDIA A100", 8, 0)] * 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _nvml.visible_gpu(1) == ("NVIDIA A100", 8, 0)


def test_nvml_that_cannot_start_answers_none(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = nvml(_MIXED, init_status=9)
    assert _nvml.visible_gpu(0) is None
    assert fake.open_sessions == 0

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f6e2a")
    nvml(_MIXED)
    assert _nvml.visible_gpu(0) is None


def test_a_machine_without_nvml_answers_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvml, "_LIBRARY", "libnvidia-ml-that-does-not-exist.so.1")
    assert _nvml.visible_gpu(0) is None


_FAKE_NVML_C = r"""
#include <string.h>
static const char *names[] = {"NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"};
static int sessions = 0;
int nvmlInit_v2(void) { sessions++; return 0; }
int nvmlShutdown(void) { sessions--; return 0; }
int lite_test_sessions(void) { return sessions; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if (index >= 2) return 2;
    *handle = (void *)(names + index);
    return 0;
}
int nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor) {
    *major = 8; *minor = handle == (void *)(names + 1) ? 6 : 0; return 0;
}
int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    strncpy(name, *(const char **)handle, length - 1); name[length - 1] = 0; return 0;
}
"""


def test_the_ctypes_calls_match_nvmls_c_signatures(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A compiled stand-in with NVML's C signatures checks how arguments and results cross ctypes.
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the stand-in NVML library")
    source, library = tmp_path / "nvml.c", tmp_path / "libfakenvml.so"
    source.write_text(_FAKE_NVML_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    monkeypatch.setattr(_nvml, "_LIBRARY", str(library))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")

    assert _nvml.visible_gpu(0) == ("NVIDIA A100-SXM4-80GB", 8, 6)
    assert ctypes.CDLL(str(library)).lite_test_sessions() == 0
