"""`progress_bar`: a tqdm progress bar for your own loop, shown once per job, not once per rank."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any, TypeVar

from lite_core.errors import MissingDependencyError

if TYPE_CHECKING:
    from lite_core.lite import LightningLite

T = TypeVar("T")


def progress_bar(iterable: Iterable[T] | None = None, lite: LightningLite | None = None, *,
                 file: IO[str] | None = None, **tqdm_kwargs: Any) -> Any:
    """Wrap `iterable` in a `tqdm` bar that shows on global rank 0 and only on a terminal.

    On other ranks, and when the output is not a terminal (a log file, CI, a pipe), the bar is
    disabled: it still iterates and accepts `update()`, `set_postfix()` and `close()`, but prints
    nothing, so the loop needs no `if` around it.

    Args:
        iterable: what to iterate (or `None` to call `update()` by hand, with `total=`).
        lite: the `LightningLite` whose rank decides; `None` means a single process.
        file: where to draw the bar (default `sys.stderr`, as tqdm does).
        **tqdm_kwargs: passed on to `tqdm.tqdm` (`total`, `desc`, `unit`, ...).

    Returns:
        A `tqdm.tqdm` object.

    Raises:
        MissingDependencyError: `tqdm` is not installed (`pip install 'lite-core[progress]'`).

    Example:
        for x, y in progress_bar(loader, self, desc=f"epoch {epoch}"):
            ...
    """
    try:
        from tqdm import tqdm
    except ImportError:
        raise MissingDependencyError(
            "progress_bar needs the tqdm package, which is not installed: run `pip install 'lite-core[progress]'`."
        ) from None
    stream = file if file is not None else sys.stderr
    shown = (lite is None or lite.is_global_zero) and _is_terminal(stream)
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, file=stream, disable=not shown, **tqdm_kwargs)


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
