"""The launcher: starts the processes of a job and runs the user's code in each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar


class Launcher(ABC):
    """Starts the job's processes; `launch` returns what rank 0's code returned."""

    #: Whether processes can be started without a function to run in them (the script
    #: launcher re-runs the script, so the code after `launch()` runs in every process).
    needs_function: ClassVar[bool] = True

    @abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the processes, run `fn(*args, **kwargs)` in each, return rank 0's result.

        `args` and `kwargs` are the user's arguments (e.g. a model passed to `run()`): each rank
        must work on its own copy of them (`lite_core.plugins.run_rank` makes it)."""

    def stop(self) -> None:
        """Stop the processes this launcher started (after this process failed)."""

    def start(self) -> None:
        """Start the processes without a function (only where `needs_function` is False)."""
        raise NotImplementedError
