"""Each package is released on its own: its version, CHANGELOG and tag agree, and the ranges that
tie the packages together (a backend's `lite-core` requirement, the core's extras) admit the
versions in this repository. Reads files only: no build, no install.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.timeout(30)

#: `## 0.2.0 — 2026-12-01` or `## 0.2.0 — unreleased` (the version being prepared).
_RELEASE_HEADING = re.compile(r"^## (?P<version>\S+) — (?P<when>\d{4}-\d{2}-\d{2}|unreleased)$", re.MULTILINE)


def _changelog(package_dir: Path) -> str:
    return (package_dir / "CHANGELOG.md").read_text(encoding="utf-8")


def _requirements(pyproject: dict[str, Any]) -> list[Requirement]:
    return [Requirement(line) for line in pyproject["project"].get("dependencies", [])]


def test_newest_changelog_entry_is_the_packages_version(package: str, packages: dict[str, Path],
                                                        build_tool: ModuleType) -> None:
    headings = [m["version"] for m in _RELEASE_HEADING.finditer(_changelog(packages[package]))]
    assert headings, f"{package}'s CHANGELOG.md has no `## <version> — <YYYY-MM-DD|unreleased>` heading"
    assert headings[0] == build_tool.package_version(packages[package]), (
        f"bump {package}'s CHANGELOG.md and src/*/__about__.py together")
    assert [Version(v) for v in headings] == sorted(map(Version, headings), reverse=True), "newest entry first"


def test_changelog_names_the_packages_own_release_tag(package: str, packages: dict[str, Path]) -> None:
    assert f"Releases are tagged `{package}-vX.Y.Z`." in _changelog(packages[package])


def test_backend_declares_a_lite_core_range_that_admits_the_current_core(
    backend: str, packages: dict[str, Path], build_tool: ModuleType
) -> None:
    core = Version(build_tool.package_version(packages["lite-core"]))
    ranges = [r.specifier for r in _requirements(build_tool.read_pyproject(packages[backend]))
              if canonicalize_name(r.name) == "lite-core"]
    assert len(ranges) == 1, f"{backend} must depend on lite-core exactly once"
    assert ranges[0].contains(core, prereleases=True), (
        f"{backend} requires lite-core{ranges[0]}, which excludes this repository's lite-core {core}:"
        f" widen the range (after running {backend}'s tests against it) or release the core differently")


def test_core_extras_admit_each_backends_current_version(packages: dict[str, Path], build_tool: ModuleType) -> None:
    extras = build_tool.read_pyproject(packages["lite-core"])["project"]["optional-dependencies"]
    pinned = {canonicalize_name(r.name): r.specifier for lines in extras.values() for r in map(Requirement, lines)
              if canonicalize_name(r.name) in packages and canonicalize_name(r.name) != "lite-core"}
    assert set(pinned) == set(packages) - {"lite-core"}, "every backend has an extra of lite-core"
    for backend, spec in pinned.items():
        version = Version(build_tool.package_version(packages[backend]))
        assert spec.contains(version, prereleases=True), (
            f"lite-core's extra requires {backend}{spec}, which excludes this repository's {backend} {version}")


def test_release_tag_names_one_package_at_its_version(packages: dict[str, Path], build_tool: ModuleType) -> None:
    for name, package_dir in packages.items():
        version = build_tool.package_version(package_dir)
        assert build_tool.package_for_tag(f"{name}-v{version}", packages) == name
        with pytest.raises(SystemExit, match=f"does not match {name}'s version {re.escape(version)}"):
            build_tool.package_for_tag(f"{name}-v{version}.post99", packages)
    with pytest.raises(SystemExit, match="names no workspace package"):
        build_tool.package_for_tag("lite-v0.1.0", packages)
