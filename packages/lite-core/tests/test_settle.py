"""A rank lets torch's collective threads finish with its last collectives before it ends.

A gloo thread that releases a finished collective's tensors while the interpreter shuts down
aborts the process (see `lite_core.strategies._settle`); here torch's thread is stood in for by
a Python thread that keeps the collective's tensor for a while, and a real one-process gloo group
shows that the wait ends as soon as torch lets go.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from lite_core.strategies import _settle
from lite_core.strategies._settle import settle_collectives


def _all_reduce_released_after(seconds: float | None, kept: list[torch.Tensor]) -> Any:
    """An all-reduce whose tensor a background thread keeps in `kept` for `seconds` (None: for good)."""

    def all_reduce(tensor: torch.Tensor) -> None:
        kept.append(tensor)
        if seconds is not None:
            threading.Timer(seconds, kept.clear).start()

    return all_reduce


@pytest.mark.timeout(60)  # a hang guard: the wait takes 0.2 s
def test_settling_waits_until_the_collective_thread_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[torch.Tensor] = []
    monkeypatch.setattr(_settle.dist, "all_reduce", _all_reduce_released_after(0.2, kept))
    assert settle_collectives(torch.device("cpu"), timeout=30.0)
    assert kept == []  # it returned once the thread had let go, not before


@pytest.mark.timeout(30)  # a hang guard: a teardown never hangs on it (it gives up after 0.1 s)
def test_settling_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[torch.Tensor] = []
    monkeypatch.setattr(_settle.dist, "all_reduce", _all_reduce_released_after(None, kept))
    assert not settle_collectives(torch.device("cpu"), timeout=0.1)
    assert len(kept) == 1  # still held: it gave up instead of waiting for good


_REAL_GLOO = """
import torch, torch.distributed as dist
from lite_core.strategies._settle import settle_collectives
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print(settle_collectives(torch.device("cpu"), timeout=30.0))
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)  # a hang guard: the process takes a few seconds, the wait milliseconds
def test_settling_ends_once_gloo_released_the_tensor() -> None:
    # In a process of its own: a test before may have left this one's default group running.
    result = subprocess.run([sys.executable, "-c", _REAL_GLOO], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True"]  # released, not given up after 30 s
