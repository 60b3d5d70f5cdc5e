"""Finds accelerators and strategies through entry points, loading only what is asked for."""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from lite_core._install import install_hint
from lite_core._known_backends import KNOWN_BACKENDS
from lite_core._suggest import closest
from lite_core.errors import (
    BackendImportError,
    BackendNotInstalledError,
    UnknownNameError,
)

#: Names provided by backends that Lite knows of, with the extra that installs each: derived from
#: `_known_backends`, which tools/known_backends.py writes from the backends' own entry points.
_KNOWN_BACKENDS: dict[str, dict[str, str]] = {
    kind: {name: extra for extra, provides in KNOWN_BACKENDS.values() for name in provides.get(kind, ())}
    for kind in ("accelerator", "strategy")
}
_EXTRA_PACKAGE = {extra: package for package, (extra, _) in KNOWN_BACKENDS.items()}


def known_backends() -> dict[str, tuple[str, dict[str, list[str]]]]:
    """Each backend package Lite knows of: (the extra that installs it, the names it provides by
    kind), e.g. `{"lite-cuda": ("cuda", {"accelerator": ["cuda", "gpu"], "strategy": ["dp"]})}`."""
    return {package: (extra, {kind: list(names) for kind, names in provides.items()})
            for package, (extra, provides) in KNOWN_BACKENDS.items()}


class Registry:
    """The plugins of one kind ("accelerator" or "strategy") in one entry-point group."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group

    def names(self) -> list[str]:
        """Every installed name, without importing any backend."""
        return sorted(_entry_points(self.group))

    def load(self, name: str) -> type[Any]:
        """Import and return the class registered as `name`, checking its backend's version."""
        found = _entry_points(self.group).get(name)
        if found is None:
            raise self._missing(name)
        if found.dist is not None and not _is_core(found.dist):
            from lite_core._compat import check_compatible  # only backends pay for `packaging`

            check_compatible(found.dist)
        try:
            return found.load()
        except Exception as err:
            dist = _dist_label(found)
            raise BackendImportError(
                f"The {self.kind} '{name}' from {dist} failed to import ({type(err).__name__}: {_first_line(err)}):"
                f" reinstall or upgrade {dist.split()[0]}, or uninstall it if you do not need it."
            ) from err

    def _missing(self, name: str) -> Exception:
        extra = _KNOWN_BACKENDS[self.kind].get(name)
        if extra is not None:
            return BackendNotInstalledError(
                f"{self.kind}={name!r} is provided by {_EXTRA_PACKAGE[extra]}, which is not installed:"
                f" run `{install_hint(extra)}`."
            )
        valid = self.names()
        guess = closest(name, valid) or closest(name, _KNOWN_BACKENDS[self.kind])
        hint = f"did you mean {guess!r}? " if guess else ""
        return UnknownNameError(
            f"{self.kind}={name!r} is not a known {self.kind}: {hint}valid names are {', '.join(valid)}."
        )


def check_instance(obj: Any) -> None:
    """Refuse an accelerator or strategy passed as an instance whose backend requires another
    lite-core, as `Registry.load` refuses one chosen by name (a subclass of a backend's class is
    checked against that backend too)."""
    packages = {cls.__module__.partition(".")[0] for cls in type(obj).__mro__}
    checked: set[str] = set()
    for group in (ACCELERATORS.group, STRATEGIES.group):
        for found in _entry_points(group).values():
            dist = found.dist
            if dist is None or _is_core(dist) or found.value.partition(".")[0].partition(":")[0] not in packages:
                continue
            if dist.metadata["Name"] not in checked:
                from lite_core._compat import check_compatible

                check_compatible(dist)
                checked.add(dist.metadata["Name"])


@cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    # Users' names are case-insensitive (the connector lowercases them), so a backend that
    # registers `MyChip` is found as `mychip`.
    return {ep.name.lower(): ep for ep in entry_points(group=group)}


def clear_cache() -> None:
    """Forget the entry points read so far (after installing a backend in this process)."""
    from lite_core._compat import core_version

    _entry_points.cache_clear()
    core_version.cache_clear()


def _is_core(dist: Any) -> bool:
    return str(dist.metadata["Name"]).lower().replace("_", "-") == "lite-core"


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


def _dist_label(found: EntryPoint) -> str:
    dist = found.dist
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else f"'{found.value}'"


ACCELERATORS = Registry("accelerator", "lite_core.accelerators")
STRATEGIES = Registry("strategy", "lite_core.strategies")
