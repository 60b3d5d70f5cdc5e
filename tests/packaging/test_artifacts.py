"""`hatch build` (through tools/build_all.py) makes a complete wheel and sdist of every package.

`package` and `backend` are parametrized by tests/packaging/conftest.py over the workspace packages.
"""

from __future__ import annotations

import configparser
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.timeout(300)  # the session's first test pays for building every package


def _import_name(name: str) -> str:
    return name.replace("-", "_")


def _declared_entry_points(pyproject: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The entry points and console scripts a pyproject.toml declares, by group."""
    project = pyproject["project"]
    declared = {group: dict(points) for group, points in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        declared["console_scripts"] = dict(project["scripts"])
    return declared


def _wheel_entry_points(wheel: zipfile.ZipFile, dist_info: str) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep names as written
    parser.read_string(wheel.read(f"{dist_info}/entry_points.txt").decode())
    return {group: dict(parser[group]) for group in parser.sections()}


def test_every_package_builds_a_wheel_and_an_sdist(
    dist: Path, package: str, packages: dict[str, Path], build_tool: ModuleType, wheel_of: Callable[[str], Path]
) -> None:
    version = build_tool.package_version(packages[package])
    sdist = dist / f"{_import_name(package)}-{version}.tar.gz"
    built = sorted(p.name for p in dist.iterdir())
    assert wheel_of(package).is_file(), built
    assert sdist.is_file(), built
    with tarfile.open(sdist) as archive:
        members = {member.split("/", 1)[1] for member in archive.getnames() if "/" in member}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", f"src/{_import_name(package)}/__about__.py"} <= members


def test_wheel_holds_py_typed_the_entry_points_and_no_tests(
    package: str, packages: dict[str, Path], build_tool: ModuleType, wheel_of: Callable[[str], Path]
) -> None:
    dist_info = f"{_import_name(package)}-{build_tool.package_version(packages[package])}.dist-info"
    with zipfile.ZipFile(wheel_of(package)) as wheel:
        files = wheel.namelist()
        assert f"{_import_name(package)}/py.typed" in files
        assert _wheel_entry_points(wheel, dist_info) == _declared_entry_points(
            build_tool.read_pyproject(packages[package]))
        tests = [f for f in files if "tests" in f.split("/") or Path(f).name.startswith(("test_", "conftest"))]
        assert tests == []
        # Only the package itself and its metadata: no stray top-level modules or data.
        assert {f.split("/")[0] for f in files} == {_import_name(package), dist_info}


def test_backend_wheel_declares_the_lite_core_versions_it_supports(
    backend: str, packages: dict[str, Path], build_tool: ModuleType, wheel_of: Callable[[str], Path]
) -> None:
    dist_info = f"{_import_name(backend)}-{build_tool.package_version(packages[backend])}.dist-info"
    with zipfile.ZipFile(wheel_of(backend)) as wheel:
        metadata = Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]
    core = [r for r in requirements if r.name == "lite-core"]
    assert len(core) == 1 and core[0].marker is None, requirements
    assert str(core[0].specifier), f"{backend} must declare which lite-core versions it supports"
