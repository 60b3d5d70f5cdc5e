"""Starts the XLA replicas through torch-xla's multiprocessing API and returns rank 0's result."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lite_core.errors import MisuseError
from lite_core.launchers.launcher import Launcher

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy


class XLALauncher(Launcher):
    """Runs `fn` once per XLA device with `torch_xla.distributed.xla_multiprocessing.spawn`.

    torch-xla starts one process per chip (on a CPU host: one process with a thread per device)
    and can only do so while this process has not started the XLA runtime itself. Rank 0's
    return value comes back through a temporary file, so it must be picklable.
    """

    def __init__(self, strategy: Strategy, start_method: str = "spawn") -> None:
        self._strategy = strategy
        self._start_method = start_method

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch_xla.distributed.xla_multiprocessing as xmp

        _refuse_started_runtime()
        _set_cpu_replicas(len(self._strategy.device_indexes))
        with tempfile.TemporaryDirectory(prefix="lite-xla-result-") as folder:
            result_file = Path(folder) / "rank0.pkl"
            xmp.spawn(_replica, args=(fn, args, kwargs, str(result_file)), nprocs=None,
                      start_method=self._start_method)
            with result_file.open("rb") as handle:
                return pickle.load(handle)


def _replica(ordinal: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             result_file: str) -> None:
    result = fn(*args, **kwargs)
    if ordinal == 0:
        with open(result_file, "wb") as handle:
            pickle.dump(result, handle)


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
