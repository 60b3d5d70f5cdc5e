"""Letting torch's collective threads finish with the last collectives before the process ends.

torch's gloo backend releases each collective's tensors on its worker thread, after the
collective has completed (a barrier also keeps the collectives still running when it started
until it is released itself); releasing a tensor that Python has seen takes the GIL. A rank that
reaches interpreter shutdown first makes that thread exit while it waits for the GIL, inside a
C++ destructor, and the process aborts after its work is done ("terminate called without an
active exception", SIGABRT). Plain PyTorch shows it too: two processes that end right after their
last collectives abort in about half of the runs on a busy machine. `settle_collectives`, called
before the process group is destroyed, waits (with the GIL released) until the background thread
has let go of one more collective's tensor, which it releases after the ones before it; on other
backends the same wait is bounded and harmless.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import torch.distributed as dist


def settle_collectives(device: torch.device, timeout: float = 30.0) -> bool:
    """Run one more all-reduce and wait until torch's background thread has released its tensor
    (C++ code holding a tensor that Python has seen holds a reference to its Python object);
    whether it did within `timeout` seconds. The wait ends as soon as it is released (about a
    millisecond); `timeout` is only a hang guard, far above what a starved thread takes (a 2 s
    bound let a rank of a loaded fresh-clone CI run abort at exit)."""
    canary = torch.zeros(1, device=device)
    alone = sys.getrefcount(canary)
    dist.all_reduce(canary)
    return wait_until(lambda: sys.getrefcount(canary) <= alone, timeout)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Check `condition` every millisecond, sleeping between checks so that threads waiting for
    the GIL get it, until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.001)
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
