"""Warnings that point at the user's line: the first frame of the stack that is not Lite's.

Python 3.12's `warnings.warn(..., skip_file_prefixes=...)` does this; this module does it on
3.11 too, without hand-counted `stacklevel`s that break whenever a call moves between functions.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

#: Top-level packages whose frames are never the user's: Lite's core and backends, the
#: standard-library wrappers (decorators, context managers) that Lite's calls pass through, and
#: torch, which calls back into Lite (a checkpoint's stateful objects loaded by torch's code).
LIBRARY_PACKAGES = frozenset({"lite_core", "lite_cuda", "lite_xla", "lite_deepspeed", "lite_torchft",
                              "functools", "contextlib", "torch"})


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the first frame outside `LIBRARY_PACKAGES`
    (the user's line), as `warnings.warn` with the right `stacklevel` would; filters, the
    `__warningregistry__` of "once"/"default" and `pytest.warns` treat it as such."""
    frame = user_frame()
    if frame is None:  # every frame is Lite's (e.g. a thread Lite started)
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)


def user_frame() -> FrameType | None:
    """The innermost frame of this thread's stack whose module is not in `LIBRARY_PACKAGES`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _is_library(frame):
        frame = frame.f_back
    return frame


def _is_library(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and name.partition(".")[0] in LIBRARY_PACKAGES
