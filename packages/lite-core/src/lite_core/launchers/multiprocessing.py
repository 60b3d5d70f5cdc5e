"""Starts every local rank as a child of this process (`spawn` or `fork`)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lite_core.errors import ConfigurationError
from lite_core.launchers.launcher import Launcher

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy


class MultiprocessingLauncher(Launcher):
    """Runs `fn` in N child processes through `torch.multiprocessing.start_processes`.

    If any child fails, the others are stopped and its traceback is raised here. Rank 0's return
    value is handed back through a temporary file (so a large result cannot block a pipe).
    """

    def __init__(self, strategy: Strategy, start_method: str) -> None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ConfigurationError(
                f"The start method '{start_method}' is not available on this platform: use"
                " strategy='ddp_spawn' instead."
            )
        self._strategy = strategy
        self._start_method = start_method

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch.multiprocessing as mp

        environment = self._strategy.environment
        assert environment is not None
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        with tempfile.TemporaryDirectory(prefix="lite-result-") as folder:
            result_file = Path(folder) / "rank0.pkl"
            mp.start_processes(
                _worker,
                args=(self._strategy, fn, args, kwargs, str(result_file)),
                nprocs=len(self._strategy.device_indexes),
                start_method=self._start_method,
            )
            with result_file.open("rb") as handle:
                return pickle.load(handle)


def _worker(local_rank: int, strategy: Strategy, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any], result_file: str) -> None:
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        strategy.teardown(failed=True)
        raise
    strategy.teardown()
    if strategy.global_rank == 0:
        with open(result_file, "wb") as handle:
            pickle.dump(result, handle)
