"""Reads a GPU's name and compute capability from NVML, the driver's management library.

Unlike the CUDA runtime, NVML can be asked in a process that later forks. Every failure (no
library, no driver, GPUs named by UUID) answers `None`, and Lite then checks in the worker.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LIBRARY = "libnvidia-ml.so.1"
_NAME_LENGTH = 96
#: A GPU as NVML describes it: name, major and minor compute capability.
Facts = tuple[str, int, int]


def visible_gpu(index: int) -> Facts | None:
    """Facts about the GPU that CUDA calls `index` (after `CUDA_VISIBLE_DEVICES`), or `None`."""
    with _session() as library:
        if library is None:
            return None
        physical = physical_indexes(os.environ.get("CUDA_VISIBLE_DEVICES"), _count(library))
        if physical is None or not 0 <= index < len(physical):
            return None
        facts = [_facts(library, p) for p in physical]
    if any(f is None for f in facts):
        return None
    if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(set(facts)) > 1:
        return None  # CUDA orders the fastest first, NVML by bus: only identical GPUs map safely
    return facts[index]


def physical_indexes(visible: str | None, total: int) -> list[int] | None:
    """The NVML indexes CUDA sees, in CUDA's order, or `None` for a list NVML cannot map (UUIDs).

    Like CUDA, parsing stops at the first entry that is not a valid index.
    """
    if visible is None:
        return list(range(total))
    indexes: list[int] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            return None
        digits = entry[: len(entry) - len(entry.lstrip("0123456789"))]
        if not digits or int(digits) >= total:
            break
        if int(digits) in indexes:
            return None
        indexes.append(int(digits))
    return indexes


@contextmanager
def _session() -> Iterator[Any]:
    try:
        library = ctypes.CDLL(_LIBRARY)
    except OSError:
        yield None
        return
    if library.nvmlInit_v2() != 0:
        yield None
        return
    try:
        yield library
    finally:
        library.nvmlShutdown()


def _count(library: Any) -> int:
    count = ctypes.c_uint(0)
    return count.value if library.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0


def _facts(library: Any, physical: int) -> Facts | None:
    handle = ctypes.c_void_p()
    if library.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(physical), ctypes.byref(handle)) != 0:
        return None
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    if library.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    name = ctypes.create_string_buffer(_NAME_LENGTH)
    if library.nvmlDeviceGetName(handle, name, ctypes.c_uint(_NAME_LENGTH)) != 0:
        return None
    return name.value.decode(errors="replace"), major.value, minor.value
