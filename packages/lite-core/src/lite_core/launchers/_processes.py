"""Child-process helpers shared by the script launcher and `lite run`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import Callable

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
    """In the child (before exec, or first thing in a worker): ask Linux to kill it with SIGKILL
    when the launching process dies. SIGKILL, because a rank blocked in a collective runs no
    Python signal handler until the collective returns."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


#: A folder a supervising launcher (`lite run`) exports; each rank that fails notes it there.
FAILURE_DIR_VARIABLE = "LITE_FAILURE_DIR"


def record_failure(local_rank: int) -> None:
    """Note the time this rank failed in `$LITE_FAILURE_DIR`, if a launcher set it.

    A rank that fails often makes the others fail a moment later (their collectives lose their
    peer), and which process exits first is a matter of interpreter shutdown time; the notes let
    the launcher blame the rank that failed first.
    """
    folder = os.environ.get(FAILURE_DIR_VARIABLE)
    if folder:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"rank{local_rank}"), "w") as handle:
                handle.write(repr(time.time()))


def rank_to_blame(folder: str, exited: int) -> int:
    """The local rank to blame when `exited` ended with an error: `exited` itself if it noted no
    failure (it died abruptly: `os._exit`, a signal), else the rank that noted one first."""
    noted: dict[int, float] = {}
    for name in os.listdir(folder):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(folder, name)) as handle:
                noted[int(name.removeprefix("rank"))] = float(handle.read())
    if exited not in noted:
        return exited
    return min(noted, key=lambda rank: noted[rank])


def describe_exit(code: int) -> str:
    """`exit code 3`, or `signal 9 (SIGKILL)` for a process ended by a signal (negative code)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def on_interrupt(callback: Callable[[], None]) -> None:
    """Call `callback` from a helper thread as soon as this process receives SIGINT (Ctrl-C).

    Python runs its own SIGINT handler (the `KeyboardInterrupt`) only when the main thread is back
    in Python code, which a rank blocked in a collective is not until the collective times out.
    Python's C-level handler also writes the signal number to the wakeup file descriptor, which
    a thread can read at once. Does nothing outside the main thread or when another wakeup file
    descriptor is already set (e.g. by a running asyncio loop).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_end), os.close(write_end)
        return

    def watch() -> None:
        while data := os.read(read_end, 64):
            if signal.SIGINT in data:
                callback()

    threading.Thread(target=watch, name="lite-interrupt", daemon=True).start()
