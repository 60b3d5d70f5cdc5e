"""Child-process helpers shared by the script launcher and `lite run`."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable

#: Seconds a child gets to exit after SIGTERM before it is killed.
GRACE_SECONDS = 5.0


def stop_processes(processes: Iterable[subprocess.Popen[bytes]], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every process still running, then SIGKILL those not gone after `grace` seconds."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def die_with_parent() -> None:
    """In the child before exec: ask Linux to kill it when the launching process dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
