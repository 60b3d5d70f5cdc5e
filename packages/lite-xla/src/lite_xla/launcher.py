"""Starts the XLA replicas through torch-xla's multiprocessing API and returns the result of this
host's first replica (rank 0's on a single host)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from lite_core.plugins import Launcher, LiteError, MisuseError, on_interrupt, own_copy, read_result, run_rank

if TYPE_CHECKING:
    from lite_core.plugins import Strategy


class XLALauncher(Launcher):
    """Runs `fn` once per XLA device with `torch_xla.distributed.xla_multiprocessing.spawn`.

    torch-xla starts one process per chip (on a CPU host: one process with a thread per device)
    and can only do so while this process has not started the XLA runtime itself. The return
    value of this host's first replica (local rank 0: rank 0 on a single host, on a TPU pod each
    host's own) comes back through a temporary file, so it must be picklable. A replica that
    raises ends its process at once (the others would wait for it in their next collective),
    which stops every replica, and `launch` raises `ReplicaFailedError`. The replica processes die
    with the launching process (SIGTERM, SIGKILL) and stop at once on its Ctrl-C.
    """

    def __init__(self, strategy: Strategy, start_method: str = "spawn") -> None:
        self._strategy = strategy
        self._start_method = start_method

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch_xla.distributed.xla_multiprocessing as xmp

        _refuse_started_runtime()
        _set_cpu_replicas(len(self._strategy.device_indexes))
        with _killed_on_interrupt(), tempfile.TemporaryDirectory(prefix="lite-xla-result-") as folder:
            result_file = Path(folder) / "rank0.pkl"
            try:
                xmp.spawn(_replica, args=(fn, args, kwargs, str(result_file), os.getpid()), nprocs=None,
                          start_method=self._start_method)
            except BrokenProcessPool as err:
                raise ReplicaFailedError(
                    "An XLA replica process ended before finishing (an error it raised is printed above)"
                    " and every replica was stopped: fix the cause and run again."
                ) from err
            return read_result(result_file)


class ReplicaFailedError(LiteError, RuntimeError):
    """An XLA replica raised (its traceback is printed on standard error), exited or was killed."""


def _replica(ordinal: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             result_file: str, launcher_pid: int) -> None:
    def on_failure(err: BaseException) -> None:
        if isinstance(err, SystemExit) and err.code in (0, None):
            return  # a clean exit ends this replica only
        _stop_every_replica(ordinal)

    # On a CPU host the replicas are threads that receive the very same `fn` (the user's
    # LightningLite object and its strategy): each takes its own copy, as a process per chip does.
    run_rank(own_copy(fn), args, kwargs, launcher_pid=launcher_pid, result_file=result_file,
             returns_result=_first_on_this_host, on_failure=on_failure)


def _first_on_this_host() -> bool:
    """Whether this replica hands its result to this host's launching process: local ordinal 0
    (on a TPU pod every host's launcher returns one; on one host it is rank 0's)."""
    import torch_xla.runtime as xr

    return xr.local_ordinal() == 0


def _stop_every_replica(ordinal: int) -> NoReturn:
    """Print the error and end this process now. torch-xla's process pool then stops the other
    replica processes (on a CPU host the replicas are threads of this one process)."""
    traceback.print_exc()
    sys.stderr.write(f"lite: XLA replica {ordinal} failed with the error above; stopping every replica.\n")
    sys.stderr.flush()
    os._exit(1)


#: Child processes that existed before the launch in progress (None: no launch in progress).
_children_before_launch: set[int] | None = None
_watching_interrupts = False


@contextlib.contextmanager
def _killed_on_interrupt() -> Iterator[None]:
    """While the replicas run, Ctrl-C kills their processes at once. Python raises the
    `KeyboardInterrupt` only later, and torch-xla's process pool would then wait for them."""
    global _children_before_launch, _watching_interrupts
    if not _watching_interrupts:
        on_interrupt(_kill_replicas)  # a helper thread, called as soon as SIGINT arrives
        _watching_interrupts = True
    _children_before_launch = {process.pid for process in multiprocessing.active_children()}
    try:
        yield
    finally:
        _children_before_launch = None


def _kill_replicas() -> None:
    before = _children_before_launch
    if before is None:
        return
    for process in multiprocessing.active_children():
        if process.pid not in before:
            process.kill()


def _refuse_started_runtime() -> None:
    import torch_xla

    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise MisuseError(
            "The XLA device was used in this process before Lite started the replicas (e.g."
            " torch_xla.device() or .to('xla') outside run()), which torch-xla cannot undo: move"
            " that code into run()."
        )


def _set_cpu_replicas(count: int) -> None:
    """On a CPU host, `CPU_NUM_DEVICES` decides how many replicas torch-xla starts."""
    if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return
    os.environ.setdefault("CPU_NUM_DEVICES", str(count))  # a different value: refused at construction
