"""The one place `lite_cuda` asks the machine about its GPUs; tests replace these functions.

Only `set_device` and `initialized_gpu` initialise CUDA, and Lite calls them in the process that
trains. Everything the parent process needs at construction (is there a GPU, how many, is it new
enough for bf16) is answered without initialising CUDA, so `ddp_fork` and notebooks keep working.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lite_cuda import _nvml


class GPU(NamedTuple):
    """What Lite needs to know about one GPU."""

    name: str
    capability: tuple[int, int]


def cuda_built() -> bool:
    """Whether the installed torch was built with CUDA."""
    return bool(torch.backends.cuda.is_built())


def device_count() -> int:
    """GPUs visible to this process (`CUDA_VISIBLE_DEVICES` applied), counted through NVML."""
    return int(torch.cuda.device_count())


def gpu(index: int) -> GPU | None:
    """Facts about visible GPU `index` without initialising CUDA, or `None` when NVML cannot say."""
    if torch.cuda.is_initialized():
        return initialized_gpu(index)
    found = _nvml.visible_gpu(index)
    return None if found is None else GPU(found[0], (found[1], found[2]))


def initialized_gpu(index: int) -> GPU:
    """Facts about visible GPU `index` from the CUDA runtime (initialises CUDA)."""
    major, minor = torch.cuda.get_device_capability(index)
    return GPU(torch.cuda.get_device_name(index), (major, minor))


def set_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device."""
    torch.cuda.set_device(device)
