"""Write lite-core's table of the backends it knows of from each backend package's entry points.

When a name that a backend registers is asked for and the backend is not installed
(`strategy="deepspeed"` without lite-deepspeed), lite-core says which package provides it and the
line that installs it. The core never imports a backend, and cannot read the entry points of one
that is not installed, so it ships the names in `lite_core/_known_backends.py`. That module is
written here from the one place each backend registers its names, its pyproject.toml's entry
points (groups `lite_core.accelerators` and `lite_core.strategies`), and from lite-core's extras
(the extra whose one requirement is the backend package installs it): never edit it by hand.

`python tools/known_backends.py` rewrites the module; `--check` fails, naming the fix, when it is
out of date (packages/lite-core/tests/test_plugins.py runs the check).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "packages" / "lite-core" / "src" / "lite_core" / "_known_backends.py"
GROUPS = {"lite_core.accelerators": "accelerator", "lite_core.strategies": "strategy"}

_HEADER = '''"""The backends lite-core knows of, for the line that installs one that is missing.

Written by tools/known_backends.py from each backend package's entry points and lite-core's
extras: do not edit; run `python tools/known_backends.py` after changing either.
"""

from __future__ import annotations

#: Backend package -> (the lite-core extra that installs it, the names it registers by kind).
KNOWN_BACKENDS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
'''


def _project(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def known_backends() -> dict[str, tuple[str, dict[str, tuple[str, ...]]]]:
    """Backend package -> (its extra, {kind: sorted names}), in the order of lite-core's extras."""
    backends = {path.parent.name for path in (ROOT / "packages").glob("lite-*/pyproject.toml")} - {"lite-core"}
    found = {}
    for extra, requirements in _project("lite-core").get("optional-dependencies", {}).items():
        names = [re.match(r"[A-Za-z0-9_.-]+", requirement).group(0) for requirement in requirements]
        if len(names) != 1 or names[0] not in backends:
            continue
        entry_points = _project(names[0]).get("entry-points", {})
        provides = {kind: tuple(sorted(entry_points[group])) for group, kind in GROUPS.items() if entry_points.get(group)}
        found[names[0]] = (extra, provides)
    missing = sorted(backends - set(found))
    if missing:
        raise SystemExit(f"{', '.join(missing)} has no extra of lite-core that installs it alone:"
                         " add one to packages/lite-core/pyproject.toml's [project.optional-dependencies].")
    return found


def render() -> str:
    """The text of `lite_core/_known_backends.py`."""
    lines = []
    for package, (extra, provides) in known_backends().items():
        lines += [f'    "{package}": ("{extra}", {{\n']
        for kind, names in provides.items():
            lines += [f'        "{kind}": (\n'] + [f'            "{name}",\n' for name in names] + ["        ),\n"]
        lines += ["    }),\n"]
    return _HEADER + "".join(lines) + "}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the module is out of date, writing nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if MODULE.read_text(encoding="utf-8") != text:
            print(f"{MODULE} does not match the backends' entry points:"
                  " run `python tools/known_backends.py`.", file=sys.stderr)
            return 1
        return 0
    MODULE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
