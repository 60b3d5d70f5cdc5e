"""Checks a backend's declared `lite-core` requirement against the installed core."""

from __future__ import annotations

from functools import cache
from importlib.metadata import Distribution, PackageNotFoundError, version

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from lite_core.errors import IncompatibleBackendError

CORE = "lite-core"


@cache
def core_version() -> Version:
    """The installed lite-core version (from its metadata, else from the source tree)."""
    try:
        return Version(version(CORE))
    except PackageNotFoundError:
        from lite_core.__about__ import __version__

        return Version(__version__)


def check_compatible(dist: Distribution) -> None:
    """Raise `IncompatibleBackendError` if `dist` requires a lite-core other than the installed one."""
    for line in dist.requires or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != CORE:
            continue
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        core = core_version()
        if not requirement.specifier.contains(core, prereleases=True):
            raise _incompatible(dist.metadata["Name"], dist.version, requirement.specifier, core)


def _incompatible(name: str, backend_version: str, spec: SpecifierSet, core: Version) -> IncompatibleBackendError:
    lower_bounds = [Version(s.version) for s in spec if s.operator in (">=", ">", "==", "~=")]
    core_is_too_old = any(bound > core for bound in lower_bounds)
    fix = f"pip install --upgrade 'lite-core{spec}'" if core_is_too_old else f"pip install --upgrade {name}"
    return IncompatibleBackendError(
        f"{name} {backend_version} needs lite-core{spec} but lite-core {core} is installed: run `{fix}`."
    )
