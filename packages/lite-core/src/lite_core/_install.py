"""The command that installs a missing piece, as it works today.

Lite's own packages are not on the package index yet, so `pip install 'lite-core[cuda]'` fails:
a backend comes from the folders of a clone of Lite's repository (the README's route), and any
other extra's packages come from the index by name, as lite-core's own metadata lists them.
"""

from __future__ import annotations

import shlex
from importlib.metadata import PackageNotFoundError, requires

#: The extras that bring one of Lite's backend packages.
BACKEND_PACKAGES = {"cuda": "lite-cuda", "xla": "lite-xla", "deepspeed": "lite-deepspeed", "torchft": "lite-torchft"}


def install_hint(extra: str) -> str:
    """`pip install ...` that installs what `lite-core[extra]` brings.

    Example:
        >>> install_hint("cuda")
        "pip install './packages/lite-core[cuda]' ./packages/lite-cuda"
        >>> install_hint("fp8")  # doctest: +SKIP
        "pip install 'torchao>=0.18'"
    """
    if extra in BACKEND_PACKAGES:
        return f"pip install './packages/lite-core[{extra}]' ./packages/{BACKEND_PACKAGES[extra]}"
    packages = _requirements_of(extra)
    if not packages:  # not an extra lite-core's metadata knows: the clone's route installs it
        return f"pip install './packages/lite-core[{extra}]'"
    return "pip install " + " ".join(shlex.quote(package) for package in packages)


def _requirements_of(extra: str) -> list[str]:
    """The requirements lite-core's metadata lists for `extra`, without their markers."""
    from packaging.requirements import Requirement

    try:
        declared = requires("lite-core") or []
    except PackageNotFoundError:
        return []
    found = []
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            requirement.marker = None
            found.append(str(requirement))
    return found
