"""Running the user's code: `run()` wrapped so that it launches, each process's execution of it
(environment, run context, waiting for checkpoints, failure handling, loggers closed), and
`launch()` without a function, after which the user's code runs outside Lite.

`LightningLite` holds a `Running`; a subclass's wrapped `run()` reaches it through `Runs`.
"""

from __future__ import annotations

import atexit
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar, cast

from lite_core.data import _sharding as _data
from lite_core.errors import MisuseError
from lite_core.launchers.supervision import record_failure

if TYPE_CHECKING:
    from lite_core.launchers.launcher import Launcher
    from lite_core.running._callbacks import Loggers
    from lite_core.running._checkpoints import Checkpoints
    from lite_core.strategies.strategy import Strategy

T = TypeVar("T")


class Runs(Protocol):
    """The part of `LightningLite` that a wrapped `run()` calls."""

    _running: Running

    def _execute(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...

    def _user_run(self, *args: Any, **kwargs: Any) -> Any: ...


def wrap_run(run: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's `run`, launched: called directly inside a run, else in every process."""
    @functools.wraps(run)
    def wrapped(self: Runs, *args: Any, **kwargs: Any) -> Any:
        if self._running.inside:
            return run(self, *args, **kwargs)
        return self._running.launch(functools.partial(self._execute, self._user_run), args, kwargs)

    return wrapped


class Running:
    """Whether this process is inside a run of the user's code, and how a run starts and ends."""

    def __init__(self, strategy: Strategy, launcher: Launcher | None, checkpoints: Checkpoints,
                 loggers: Loggers) -> None:
        self._strategy = strategy
        self._launcher = launcher
        self._checkpoints = checkpoints
        self._loggers = loggers
        self.inside = False

    def __getstate__(self) -> dict[str, Any]:
        # The launcher holds processes and threads: a copy sent to a worker runs inside it.
        return {**self.__dict__, "_launcher": None}

    def launch(self, worker: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """`worker(*args, **kwargs)` here, or in every process the launcher starts. The user's
        arguments travel apart from `worker` so that a launcher can give each rank its own copy."""
        if self.inside or self._launcher is None:
            return worker(*args, **kwargs)
        return cast(T, self._launcher.launch(worker, *args, **kwargs))

    def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in this process, set up and inside the strategy's run context."""
        strategy = self._strategy
        strategy.setup_environment()
        outer, self.inside = self.inside, True
        if not outer:
            self._loggers.begin()
        try:
            with strategy.run_context(), _data.recording_loader_arguments():
                result = fn(*args, **kwargs)
                self._checkpoints.wait()
                return result
        except BaseException as err:
            self._checkpoints.abandon()
            strategy.mark_failed()
            if not _is_clean_exit(err):
                record_failure(strategy.local_rank)
            raise
        finally:
            self.inside = outer
            if not outer:
                self._loggers.finalize()

    def launch_without_function(self) -> None:
        """`launch()` with no function: start the processes (where the launcher re-runs the script)
        and set this one up; the code after `launch()` then runs in every process."""
        _launch_without_function(self._strategy, self._launcher, self._loggers.finalize)


def _launch_without_function(strategy: Strategy, launcher: Launcher | None,
                             finalize_loggers: Callable[[], None]) -> None:
    """`launch()` with no function: start the processes (where the launcher re-runs the script)
    and set this one up; the code after `launch()` then runs in every process."""
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
