"""What Lite supervises itself, beside torch's elastic agent (which runs `lite run` and every
restart, see `lite_core.launchers.elastic`): rank processes that die with their launcher, the
script launcher's watchdog over the ranks it starts beside itself (`RankProcesses`), the notes
that blame the rank that failed first, Ctrl-C while blocked in a collective, and the body of a
rank that a launcher's own child runs (`run_rank`: `ddp_spawn`, `ddp_fork`, lite-xla's).

Part of the plugin interface (`lite_core.plugins`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Collection
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: Seconds a child gets to exit after SIGTERM before it is killed.
GRACE_SECONDS = 5.0


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


def failure_notes(folder: str) -> dict[int, float]:
    """{local rank: when it failed} for every rank that noted a failure in `folder` (see `record_failure`)."""
    noted: dict[int, float] = {}
    for name in os.listdir(folder):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(folder, name)) as handle:
                noted[int(name.removeprefix("rank"))] = float(handle.read())
    return noted


def rank_to_blame(folder: str, failed: Collection[int]) -> tuple[int, int]:
    """`(first, exited)` among the local ranks `failed` (not empty) that ended with an error.

    `first` is the rank that failed first: the lowest of `failed` that noted no failure in
    `folder` (it died abruptly: `os._exit`, a signal), else the rank that noted one first, which
    may have ended well or not yet. `exited` is the rank of `failed` whose exit code to report:
    `first` if it is among them, else the one of them that noted its failure first.
    """
    noted = failure_notes(folder)
    abrupt = sorted(rank for rank in failed if rank not in noted)
    first = abrupt[0] if abrupt else min(noted, key=lambda rank: noted[rank])
    exited = first if first in failed else min(failed, key=lambda rank: noted[rank])
    return first, exited


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


# -- the rank side ------------------------------------------------------------------------------
def start_rank(launcher_pid: int) -> None:
    """First thing in a rank process that a launcher started: die with the launcher, and exit at
    once if the launcher already died before the parent-death signal was armed."""
    die_with_parent()
    if os.getppid() != launcher_pid:
        os._exit(1)


def run_rank(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, launcher_pid: int,
             result_file: str, returns_result: Callable[[], bool], on_failure: Callable[[BaseException], None],
             on_success: Callable[[], None] = lambda: None) -> None:
    """The body of a rank process: `fn(*args, **kwargs)` on this rank's own copy of the arguments
    (see `own_copy`), then rank 0's result into `result_file`.

    Args:
        fn: the user's function (wrapped by `LightningLite`).
        args: its positional arguments.
        kwargs: its keyword arguments.
        launcher_pid: the process that started this rank (see `start_rank`).
        result_file: where the rank for which `returns_result()` is true pickles the result.
        returns_result: called after `on_success`: whether this rank hands back the result.
        on_failure: called with the exception `fn` raised (`SystemExit` included) before it goes
            on; it may end the process instead (e.g. to stop the other replicas at once).
        on_success: called after `fn` returned (e.g. to tear the strategy down).
    """
    start_rank(launcher_pid)
    args, kwargs = own_copy(args), own_copy(kwargs)
    try:
        result = fn(*args, **kwargs)
    except BaseException as err:
        on_failure(err)
        raise
    on_success()
    if returns_result():
        write_result(result, result_file)


def write_result(result: Any, path: str) -> None:
    """Pickle a rank's result where its launcher reads it (a file: a large result cannot block a pipe)."""
    with open(path, "wb") as handle:
        pickle.dump(result, handle)


def read_result(path: str | os.PathLike[str]) -> Any:
    """The result `write_result` stored."""
    with open(path, "rb") as handle:
        return pickle.load(handle)


def own_copy(value: T) -> T:
    """A deep copy of `value` that no other rank shares. Spawned ranks receive tensors (and
    modules' parameters) through shared memory, forked ranks may inherit shared storage, and
    replicas that are threads of one process see the very same objects: without a copy every
    rank would update the same weights. An item that refuses to be copied is passed as it is."""
    try:
        return copy.deepcopy(value)
    except Exception:  # e.g. an object that refuses to be copied: passed as it came, per item
        if isinstance(value, dict):
            return {key: own_copy(item) for key, item in value.items()}  # type: ignore[return-value]
        if isinstance(value, tuple):
            return tuple(own_copy(item) for item in value)  # type: ignore[return-value]
        return value


# -- the launcher side: rank processes started with `subprocess` ----------------------------------
class RankProcesses:
    """Local rank processes started with `subprocess`, each dying with this process.

    `watch` reports the first rank that fails (one waiter thread per rank notes each exit the
    moment it happens, so the rank that failed first is reported, not one that failed because of
    it a moment later); `stop` ends every rank still running.
    """

    def __init__(self) -> None:
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._signalled: dict[int, set[int]] = {}  # the signals `stop` sent each rank: not failures
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def start(self, local_rank: int, command: list[str], env: dict[str, str]) -> None:
        """Start local rank `local_rank` as `command` with environment `env` (its output goes to
        this process's stdout and stderr)."""
        process = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
        self._processes[local_rank] = process
        threading.Thread(target=lambda: self._exits.put((local_rank, process.wait())), daemon=True).start()

    def __len__(self) -> int:
        return len(self._processes)

    def watch(self, interrupted: Callable[[], bool] = lambda: False, poll: float = 0.05) -> tuple[int, int] | None:
        """Block until a rank fails, returning `(local_rank, exit code)`; `None` once every rank
        has ended without failing, or as soon as `interrupted()` is true."""
        remaining = len(self._processes)
        while remaining:
            if interrupted():
                return None
            try:
                local_rank, code = self._exits.get(timeout=poll)
            except queue.Empty:
                continue
            remaining -= 1
            if code != 0 and not self._was_stopped(local_rank, code):
                return local_rank, code
        return None

    def _was_stopped(self, local_rank: int, code: int) -> bool:
        # Only the signal `stop` sent: a rank SIGKILLed by someone else while `stop` was sending it
        # SIGTERM (it may already have been dead, not yet reaped) still failed.
        return code < 0 and -code in self._signalled.get(local_rank, set())

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM every rank still running, SIGKILL those not gone after `grace` seconds."""
        # `returncode`, not `poll()`: while a waiter thread is in `wait()`, `poll()` answers None
        # even for a rank that has died.
        running = {r: p for r, p in self._processes.items() if p.returncode is None}
        for local_rank, process in running.items():
            self._send(local_rank, process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for local_rank, process in running.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._send(local_rank, process, signal.SIGKILL)
                process.wait()

    def _send(self, local_rank: int, process: subprocess.Popen[bytes], signum: int) -> None:
        self._signalled.setdefault(local_rank, set()).add(signum)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    def wait(self) -> None:
        """Wait until every rank has ended."""
        for process in self._processes.values():
            process.wait()


def exit_code(code: int) -> int:
    """The exit code a launcher passes on for a rank that ended with `code` (128 + N for signal N)."""
    return code if code > 0 else 128 - code
