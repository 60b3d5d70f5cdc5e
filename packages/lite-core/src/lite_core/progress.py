"""`progress_bar`: a tqdm progress bar for your own loop, shown once per job, not once per rank."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from functools import cache
from typing import IO, TYPE_CHECKING, Any, TypeVar

from lite_core.errors import MissingDependencyError
from lite_core._install import install_hint

if TYPE_CHECKING:
    from lite_core.lite import LightningLite

T = TypeVar("T")


#: Off a terminal, how many plain lines a loop of known length prints (one every 5% of it).
_LINES_PER_TOTAL = 20
#: Off a terminal, every how many iterations a loop of unknown length prints a line.
_EVERY_WITHOUT_TOTAL = 100


def progress_bar(iterable: Iterable[T] | None = None, lite: LightningLite | None = None, *,
                 file: IO[str] | None = None, **tqdm_kwargs: Any) -> Any:
    """Wrap `iterable` in a `tqdm` bar that shows on global rank 0: drawn on a terminal, plain lines elsewhere.

    When the output is not a terminal (a log file, CI, a scheduler's output, a pipe) rank 0 prints
    a plain line instead of redrawing a bar: at the start, every 1/20 of `total` (every 100
    iterations without one; `miniters=N` chooses every N) and at the end, e.g.
    `train: 25% 5/20 [00:01<00:03, 4.90it/s, loss=0.3]`. How often depends on the iterations alone,
    never on time. On the other ranks the bar is disabled: it still iterates and accepts
    `update()`, `set_postfix()` and `close()`, but prints nothing, so the loop needs no `if` around it.

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
            f"progress_bar needs the tqdm package, which is not installed: run `{install_hint('progress')}`."
        ) from None
    stream = file if file is not None else sys.stderr
    if lite is not None and not lite.is_global_zero:
        return tqdm(iterable, file=stream, disable=True, **tqdm_kwargs)
    if not _is_terminal(stream):
        return _lines_class(tqdm)(iterable, file=stream, **tqdm_kwargs)
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, file=stream, **tqdm_kwargs)


@cache
def _lines_class(tqdm: type) -> type:
    """A `tqdm` subclass that prints a plain line every so many iterations instead of drawing a bar."""

    class PlainLines(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, iterable: Any = None, *args: Any, miniters: int | None = None, **kwargs: Any) -> None:
            self._every = miniters
            self._next_line = 0
            self._printed: float | None = None
            # Every iteration reaches display(), which decides by the count alone whether to print.
            kwargs.pop("mininterval", None)
            super().__init__(iterable, *args, miniters=1, mininterval=0, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg is None and self.n >= self._next_line:
                self._print_line()
            return True

        def close(self) -> None:
            if self.disable:
                return
            if self.n != self._printed:  # the end: where the loop finished or stopped
                self._print_line()
            self.disable = True
            self._decr_instances(self)

        def _print_line(self) -> None:
            every = self._every or _default_every(self.total)
            self._printed = self.n
            self._next_line = (self.n // every + 1) * every
            try:
                self.fp.write(self.format_meter(**{**self.format_dict, "ncols": 0}) + "\n")
                self.fp.flush()
            except ValueError:  # the stream was closed (a bar left open until the interpreter exits)
                pass

    return PlainLines


def _default_every(total: float | None) -> int:
    if not total:
        return _EVERY_WITHOUT_TOTAL
    return max(1, math.ceil(total / _LINES_PER_TOTAL))


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
