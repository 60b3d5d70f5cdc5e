"""Environment variables set for a while and put back as they were."""

from __future__ import annotations

import os

#: Set by `lite run` (its elastic launch) in every rank it starts: the launcher's pid, which each
#: rank checks against its parent's. Its presence also tells a rank that `lite run` started it.
LAUNCHER_PID_VARIABLE = "LITE_LAUNCHER_PID"


def export_environ(**values: str) -> dict[str, str | None]:
    """Set `values` in `os.environ`.

    Returns:
        What they replaced, by name (`None` where a name was absent), for `restore_environ`.
    """
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    return before


def restore_environ(before: dict[str, str | None]) -> None:
    """Put the variables in `before` back as they were (`None`: remove the variable)."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
