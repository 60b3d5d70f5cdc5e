"""Makes this checkout's packages importable with their entry points, without pip or a network.

    python benchmarks/_dev_site.py SITE_DIR packages/lite-core packages/lite-cuda

Writes a minimal `<name>-<version>.dist-info` (METADATA with the dependencies, entry_points.txt)
per package into SITE_DIR. Put SITE_DIR and each package's `src` on PYTHONPATH: Lite then finds
the backends through `importlib.metadata` exactly as after `pip install`. Used by gpu_check.sh on
GPU machines that have torch but cannot reach a package index.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def write_dist_info(site: Path, package: Path) -> Path:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    name = project["name"]
    about = next((package / "src").glob("*/__about__.py"))
    version = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text()).group(1)  # type: ignore[union-attr]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    requires = "".join(f"Requires-Dist: {r}\n" for r in project.get("dependencies", []))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")
    groups = project.get("entry-points", {})
    lines = [f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) for group, points in groups.items()]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info


def main() -> None:
    site = Path(sys.argv[1])
    for package in sys.argv[2:]:
        print(write_dist_info(site, Path(package)))


if __name__ == "__main__":
    main()
