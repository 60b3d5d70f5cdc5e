"""Starts every local rank as a child of this process (`spawn` or `fork`)."""

from __future__ import annotations

import ast
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lite_core.environ import export_environ, restore_environ
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.launchers._cores import (
    THREADS_VARIABLE,
    rank_threads,
    say,
    threads_notice,
    warn_if_oversubscribed,
)
from lite_core.launchers.launcher import Launcher
from lite_core.launchers.script import main_script
from lite_core.launchers.supervision import GRACE_SECONDS, read_result, run_rank

if TYPE_CHECKING:
    from lite_core._roles import SpawnsRanks

#: The traceback of the rank that failed first; the others usually fail only because of it.
_FIRST_FAILURE = "first_failure.pkl"


class MultiprocessingLauncher(Launcher):
    """Runs `fn` in N child processes through `torch.multiprocessing.start_processes`.

    If any child fails, the others are stopped and its traceback is raised here. If this process
    is interrupted (Ctrl-C) the children are stopped before the `KeyboardInterrupt` goes on; if it
    dies, Linux kills them (parent-death signal). Rank 0's return value is handed back through a
    temporary file (so a large result cannot block a pipe).
    """

    def __init__(self, strategy: SpawnsRanks, start_method: str) -> None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ConfigurationError(
                f"The start method '{start_method}' is not available on this platform: use"
                " strategy='ddp_spawn' instead."
            )
        self._strategy = strategy
        self._start_method = start_method

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch.multiprocessing as mp

        if self._start_method != "fork":
            _refuse_unguarded_main(self._strategy.name)
        environment = self._strategy.environment
        assert environment is not None
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        processes = len(self._strategy.device_indexes)
        warn_if_oversubscribed(processes)
        threads = _rank_threads(processes)
        with tempfile.TemporaryDirectory(prefix="lite-result-") as folder:
            result_file = Path(folder) / "rank0.pkl"
            try:
                before = export_environ(**({THREADS_VARIABLE: str(threads)} if threads else {}))
                try:  # spawned ranks read the variable when torch starts; forked ones set it (`_worker`)
                    context = mp.start_processes(
                        _worker,
                        args=(self._strategy, fn, args, kwargs, str(result_file), os.getpid(), threads),
                        nprocs=processes,
                        start_method=self._start_method,
                        join=False,
                    )
                finally:
                    restore_environ(before)  # this process is no rank: its own setting stays
                _join(context)
            except mp.ProcessRaisedException as err:
                _raise_first_failure(result_file.with_name(_FIRST_FAILURE), err)
                raise
            return read_result(result_file)


def _join(context: Any) -> None:
    """Wait for every child; if this process is interrupted meanwhile, stop them first."""
    try:
        while not context.join():
            pass
    except BaseException:
        _stop(context.processes)
        raise


def _stop(processes: list[Any]) -> None:
    """SIGTERM every child still running, then SIGKILL those not gone after the grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _rank_threads(processes: int) -> int | None:
    """The threads each rank computes on (see `lite_core.launchers._cores`), said once when that
    leaves cores idle; None: the ranks keep torch's default."""
    threads = rank_threads(processes)
    notice = threads_notice(processes, threads) if threads is not None else None
    if notice is not None:
        say(notice)
    return threads


def _worker(local_rank: int, strategy: SpawnsRanks, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any], result_file: str, parent_pid: int, threads: int | None) -> None:
    # `run_rank` arms the parent-death signal first: it replaces torch's SIGINT, which a rank
    # blocked in a collective would ignore.
    os.environ["LOCAL_RANK"] = str(local_rank)
    if threads is not None:  # a forked rank has the parent's pool, sized before the variable was set
        import torch

        torch.set_num_threads(threads)

    def on_failure(err: BaseException) -> None:
        _record_failure(Path(result_file).with_name(_FIRST_FAILURE), local_rank)
        strategy.teardown(failed=True)

    run_rank(fn, args, kwargs, launcher_pid=parent_pid, result_file=result_file,
             returns_result=lambda: strategy.global_rank == 0, on_failure=on_failure,
             on_success=strategy.teardown)


def _refuse_unguarded_main(strategy_name: str) -> None:
    """Refuse, before any rank starts, a launch from the top level of a script that has no
    `if __name__ == "__main__":` guard: each spawned rank imports the script, which would run
    the launch again in every rank (multiprocessing then fails with pages of tracebacks)."""
    path = main_script()
    if path is None:
        return  # a REPL or notebook: the ranks import nothing of it
    main = sys.modules["__main__"]
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or _inside_main_guard(Path(path), frame.f_lineno):
        return
    raise MisuseError(
        f"strategy={strategy_name!r} starts each rank by importing your script, which would start training"
        " again in every rank: put the code that runs it under `if __name__ == \"__main__\":`."
    )


def _inside_main_guard(script: Path, line: int) -> bool:
    try:
        tree = ast.parse(script.read_text(), str(script))
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let multiprocessing speak
    return any(isinstance(node, ast.If) and _tests_main_name(node.test)
               and node.lineno <= line <= (node.end_lineno or node.lineno) for node in tree.body)


def _tests_main_name(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
    return names and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)


def _record_failure(path: Path, local_rank: int) -> None:
    """Keep this rank's traceback unless another rank has already failed (before teardown, so
    that the ranks failing on the closed connections come later)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError:
        return
    with os.fdopen(fd, "wb") as handle:
        pickle.dump((local_rank, os.getpid(), traceback.format_exc()), handle)


def _raise_first_failure(path: Path, err: Exception) -> None:
    """Raise the first failure when torch reports another rank's (e.g. a "connection closed")."""
    import torch.multiprocessing as mp

    try:
        with path.open("rb") as handle:
            local_rank, pid, trace = pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        return
    if local_rank == getattr(err, "error_index", None):
        return
    message = f"\n\n-- Process {local_rank:d} failed first, with the following error:\n{trace}"
    raise mp.ProcessRaisedException(message, local_rank, pid) from err
