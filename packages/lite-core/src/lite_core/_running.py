"""Running the user's code: `run()` wrapped so that it launches, each process's execution of it
(environment, run context, waiting for checkpoints, failure handling, loggers closed), and
`launch()` without a function, after which the user's code runs outside Lite.

`LightningLite` hands itself in, typed by `Runs`: the part of it that this module uses.
"""

from __future__ import annotations

import atexit
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from lite_core import _data
from lite_core.errors import MisuseError
from lite_core.launchers.supervision import record_failure

if TYPE_CHECKING:
    from lite_core.checkpoint._background import BackgroundSaves
    from lite_core.launchers.launcher import Launcher
    from lite_core.strategies.strategy import Strategy

T = TypeVar("T")


class Runs(Protocol):
    """What running the user's code reads and sets on the `LightningLite` it runs for."""

    _strategy: Strategy
    _inside_run: bool
    _background_saves: BackgroundSaves

    @property
    def local_rank(self) -> int: ...

    def _launch(self, worker: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def _execute(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...

    def _user_run(self, *args: Any, **kwargs: Any) -> Any: ...

    def _finalize_loggers(self) -> None: ...

    def wait_for_checkpoint(self) -> None: ...


def wrap_run(run: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's `run`, launched: called directly inside a run, else in every process."""
    @functools.wraps(run)
    def wrapped(self: Runs, *args: Any, **kwargs: Any) -> Any:
        if self._inside_run:
            return run(self, *args, **kwargs)
        return self._launch(functools.partial(self._execute, self._user_run), args, kwargs)

    return wrapped


def execute(lite: Runs, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """`fn(*args, **kwargs)` in this process, set up and inside the strategy's run context."""
    lite._strategy.setup_environment()
    outer, lite._inside_run = lite._inside_run, True
    try:
        with lite._strategy.run_context(), _data.recording_loader_arguments():
            result = fn(*args, **kwargs)
            lite.wait_for_checkpoint()
            return result
    except BaseException as err:
        lite._background_saves.abandon()
        lite._strategy.mark_failed()
        if not _is_clean_exit(err):
            record_failure(lite.local_rank)
        raise
    finally:
        lite._inside_run = outer
        if not outer:
            lite._finalize_loggers()


def launch_without_function(strategy: Strategy, finalize_loggers: Callable[[], None]) -> None:
    """`launch()` with no function: start the processes (where the launcher re-runs the script)
    and set this one up; the code after `launch()` then runs in every process."""
    launcher = strategy.launcher
    if launcher is not None and launcher.needs_function:
        raise MisuseError(
            f"strategy={strategy.name!r} starts processes that need code to run: pass a"
            " function, launch(train), or put your loop in run()."
        )
    if launcher is not None:
        launcher.start()
    strategy.setup_environment()
    _fail_fast_on_uncaught_exception(strategy, launcher)
    atexit.register(finalize_loggers)


def _fail_fast_on_uncaught_exception(strategy: Strategy, launcher: Launcher | None) -> None:
    """After `launch()` without a function the user's code runs outside Lite: an exception that
    ends this process must still skip the closing barrier and stop the ranks it started."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        strategy.mark_failed()
        record_failure(strategy.local_rank)
        if launcher is not None:
            launcher.stop()
        previous(*exc_info)

    sys.excepthook = hook


def _is_clean_exit(err: BaseException) -> bool:
    return isinstance(err, SystemExit) and err.code in (0, None)
