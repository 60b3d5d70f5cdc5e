"""Constructor defaults that `lite run` (or the user's shell) can set through the environment.

Precedence, for each of `accelerator`, `strategy`, `devices`, `num_nodes` and `precision`:

1. a value passed to `LightningLite(...)` in code wins; if the environment holds a different
   one, a warning names the variable that was ignored;
2. otherwise the environment variable (`LITE_ACCELERATOR`, ...) is used;
3. otherwise, for `devices` and `num_nodes`, the counts of the launcher or scheduler that started
   the processes (torchrun, SLURM, MPI, Kubeflow, Ray, ...: `ClusterEnvironment.process_counts`),
   so a script that names no counts runs under any of them;
4. otherwise the default written in the signature (`"auto"`, `1`, `"32-true"`).
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from lite_core._user_frame import warn_user
from lite_core.environ import LAUNCHER_PID_VARIABLE
from lite_core.errors import ConfigurationError

#: Constructor argument -> the environment variable that supplies its default.
VARIABLES: dict[str, str] = {
    "accelerator": "LITE_ACCELERATOR",
    "strategy": "LITE_STRATEGY",
    "devices": "LITE_DEVICES",
    "num_nodes": "LITE_NUM_NODES",
    "precision": "LITE_PRECISION",
}
#: Arguments that, left at their defaults, take the counts of the launcher that started the processes.
LAUNCHER_COUNTS = ("devices", "num_nodes")
#: Legacy arguments that choose `accelerator` and `devices` themselves.
_LEGACY = {"gpus": ("accelerator", "devices"), "tpu_cores": ("accelerator", "devices")}

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class LeftToLauncher:
    """The value `from_environment` gives a count in `LAUNCHER_COUNTS` that neither the code nor
    the environment chose: the count of the launcher that started the processes, if one did
    (the connector asks the cluster environment), else `default`, the signature's."""

    default: Any

    def resolve(self, launchers_count: Any | None) -> Any:
        """The launcher's count, or `default` where no launcher gave one (`None`)."""
        return self.default if launchers_count is None else launchers_count


def from_environment(init: F) -> F:
    """Wrap `__init__` so that arguments the caller left out come from `VARIABLES` when set, and
    counts that neither chose arrive as `LeftToLauncher` values."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        decided = _apply(bound.arguments)
        for name in LAUNCHER_COUNTS:  # what neither the code nor the environment chose is the launcher's
            if name not in bound.arguments and name not in decided:
                bound.arguments[name] = LeftToLauncher(signature.parameters[name].default)
        return init(*bound.args, **bound.kwargs)

    return wrapper  # type: ignore[return-value]


def _apply(given: dict[str, Any]) -> set[str]:
    """Fill `given` from `VARIABLES`; return the arguments that legacy ones (`gpus=`) decide."""
    decided = {name for legacy, names in _LEGACY.items() if given.get(legacy) is not None for name in names}
    for name, variable in VARIABLES.items():
        raw = os.environ.get(variable, "").strip()
        if not raw or name in decided:
            continue
        value = parse(name, variable, raw)
        if name not in given:
            given[name] = value
        elif not _same(given[name], value) and not _counts_of_started_processes(name):
            warn_user(
                f"{variable}={raw!r} is ignored because the code passes {name}={given[name]!r}: remove the"
                " argument from LightningLite(...) to let the command line or environment choose it."
            )
    return decided


def _counts_of_started_processes(name: str) -> bool:
    """Whether `name` is a count of processes that `lite run` already started: the code's value
    cannot win there, and the cluster environment refuses a mismatch in one sentence."""
    return name in LAUNCHER_COUNTS and LAUNCHER_PID_VARIABLE in os.environ


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
    """Whether the code's value and the variable's mean the same (names are case-insensitive)."""
    return value == parsed or str(value).lower() == str(parsed).lower()
