"""Build the wheel and the sdist of every workspace package with `hatch build`, into one folder.

`python tools/build_all.py` (or `hatch run release:build`) builds each `packages/*` into `dist/`;
`--out DIR` writes elsewhere; naming packages builds only those (`... lite-xla`); `--tag
lite-xla-v0.2.0` builds the one package that tag releases, after checking that the tag's version
is the package's version. Packages are released independently: see docs/releasing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)
# Set by `hatch run`; a nested `hatch build` must treat the package directory as its own project.
_HATCH_SESSION_VARIABLES = ("HATCH_ENV_ACTIVE", "HATCH_PROJECT_ROOT")


def workspace_packages() -> dict[str, Path]:
    """Every distribution in `packages/`, by its name (`lite-core`, ...), to its directory."""
    found = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        found[read_pyproject(pyproject.parent)["project"]["name"]] = pyproject.parent
    return found


def read_pyproject(package_dir: Path) -> dict[str, Any]:
    """The parsed `pyproject.toml` of one package."""
    return tomllib.loads((package_dir / "pyproject.toml").read_text(encoding="utf-8"))


def package_version(package_dir: Path) -> str:
    """The version a package declares in the file its `[tool.hatch.version] path` names."""
    about = package_dir / read_pyproject(package_dir)["tool"]["hatch"]["version"]["path"]
    match = _VERSION_LINE.search(about.read_text(encoding="utf-8"))
    if match is None:
        raise SystemExit(f"{about} has no `__version__ = \"...\"` line: add one.")
    return match.group(1)


def release_tag(name: str, version: str) -> str:
    """The git tag that releases `version` of the distribution `name`: `lite-xla-v0.2.0`."""
    return f"{name}-v{version}"


def package_for_tag(tag: str, packages: dict[str, Path]) -> str:
    """The distribution a release tag names, refusing a tag whose version is not the package's."""
    for name, package_dir in packages.items():
        if tag.startswith(f"{name}-v"):
            declared = package_version(package_dir)
            if tag != release_tag(name, declared):
                raise SystemExit(f"tag {tag} does not match {name}'s version {declared}: bump the version in"
                                 f" {package_dir.relative_to(ROOT)} or tag {release_tag(name, declared)}.")
            return name
    raise SystemExit(f"tag {tag} names no workspace package: use <package>-v<version> with one of"
                     f" {', '.join(packages)}.")


def remove_old_artifacts(name: str, out: Path) -> None:
    """Delete the wheels and sdists of `name` already in `out`, so that only the new build remains."""
    prefix = name.replace("-", "_") + "-"
    for artifact in out.glob(f"{prefix}*"):
        if artifact.suffix == ".whl" or artifact.name.endswith(".tar.gz"):
            artifact.unlink()


def build(package_dir: Path, out: Path) -> None:
    """Run `hatch build` (sdist and wheel) in one package's directory, writing into `out`."""
    hatch = shutil.which("hatch")
    if hatch is None:
        raise SystemExit("hatch is not on PATH: run `pip install hatch`, then build again.")
    env = {key: value for key, value in os.environ.items() if key not in _HATCH_SESSION_VARIABLES}
    subprocess.run([hatch, "build", str(out)], cwd=package_dir, env=env, check=True)


def main(argv: list[str]) -> int:
    """Build the chosen packages (all by default); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", help="distributions to build (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="output folder (default: dist/)")
    parser.add_argument("--tag", help="build only the package this release tag names, e.g. lite-xla-v0.2.0")
    args = parser.parse_args(argv)
    packages = workspace_packages()
    chosen = [package_for_tag(args.tag, packages)] if args.tag else args.packages or list(packages)
    unknown = sorted(set(chosen) - set(packages))
    if unknown:
        parser.error(f"unknown package(s) {', '.join(unknown)}: choose from {', '.join(packages)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        print(f"== {name} {package_version(packages[name])}", flush=True)
        remove_old_artifacts(name, out)
        build(packages[name], out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
