"""Constructor defaults that `lite run` (or the user's shell) can set through the environment.

Precedence, for each of `accelerator`, `strategy`, `devices`, `num_nodes` and `precision`:

1. a value passed to `LightningLite(...)` in code wins; if the environment holds a different
   one, a warning names the variable that was ignored;
2. otherwise the environment variable (`LITE_ACCELERATOR`, ...) is used;
3. otherwise the documented default (`"auto"`, `1`, `"32-true"`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from lite_core.errors import ConfigurationError

#: Constructor argument -> the environment variable that supplies its default.
VARIABLES: dict[str, str] = {
    "accelerator": "LITE_ACCELERATOR",
    "strategy": "LITE_STRATEGY",
    "devices": "LITE_DEVICES",
    "num_nodes": "LITE_NUM_NODES",
    "precision": "LITE_PRECISION",
}


class _DefaultStr(str):
    """A default string argument: equal to the documented value, but known not to be explicit."""

    __slots__ = ()


class _DefaultInt(int):
    """A default integer argument: equal to the documented value, but known not to be explicit."""

    __slots__ = ()


AUTO = _DefaultStr("auto")
ONE_NODE = _DefaultInt(1)
FULL_PRECISION = _DefaultStr("32-true")


def resolve(arguments: dict[str, Any], stacklevel: int) -> dict[str, Any]:
    """Return `arguments` with each default replaced by its environment variable, when set.

    An explicit argument that disagrees with its variable is kept, with a warning.
    """
    resolved = {}
    for name, value in arguments.items():
        variable = VARIABLES[name]
        raw = os.environ.get(variable, "").strip()
        if isinstance(value, (_DefaultStr, _DefaultInt)):
            resolved[name] = parse(name, variable, raw) if raw else type(value).__mro__[1](value)
            continue
        if raw and not _same(value, parse(name, variable, raw)):
            warnings.warn(
                f"{variable}={raw!r} is ignored because the code passes {name}={value!r}: remove the"
                f" argument from LightningLite(...) to let the command line or environment choose it.",
                UserWarning, stacklevel=stacklevel + 1,
            )
        resolved[name] = value
    return resolved


def parse(name: str, variable: str, raw: str) -> Any:
    """The value of `variable` (holding `raw`) as the argument `name` takes it."""
    if name == "num_nodes":
        if not raw.isdigit():
            raise ConfigurationError(f"{variable}={raw!r} is not a number of nodes: set it to a positive integer.")
        return int(raw)
    if name == "devices" and raw.isdigit():
        return int(raw)
    return raw


def _same(value: Any, parsed: Any) -> bool:
    return value == parsed or str(value) == str(parsed)
