"""`lite run --replica-groups N`: hands the job to the backend that registered the `replica_groups`
entry point in the `lite_core.launchers` group (lite-torchft: a lighthouse and N groups on this
machine). The core names no backend: without one installed, the flag is refused in one sentence."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points

from lite_core.errors import ConfigurationError
from lite_core._install import install_hint

_GROUP, _NAME = "lite_core.launchers", "replica_groups"


def without_flag(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """The `--replica-groups` count in `argv` (None if absent) and `argv` without it.

    Only options before the script count; the script's own arguments are left alone.
    """
    rest, groups, index = list(argv), None, 0
    while index < len(rest) and rest[index].startswith("-"):
        flag = rest[index]
        if flag == "--replica-groups" and index + 1 < len(rest):
            groups = _count(rest.pop(index + 1))
            rest.pop(index)
            continue
        if flag.startswith("--replica-groups="):
            groups = _count(rest.pop(index).split("=", 1)[1])
            continue
        index += 1
    return groups, rest


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigurationError(f"--replica-groups {value} is not a positive number: pass how many groups to start.")
    return int(value)


def launch_groups(groups: int, argv: list[str], name: str) -> int:
    """Run `lite run argv` as `groups` replica groups through the installed backend."""
    found = [ep for ep in entry_points(group=_GROUP) if ep.name == _NAME]
    if not found:
        raise ConfigurationError(f"--replica-groups needs a fault-tolerance backend: {install_hint('torchft')}.")
    return int(found[0].load()(groups, argv, name))
