"""The layers of docs/architecture.md hold: `lint-imports` (import-linter) checks the contracts in
`.importlinter` at the repository root against the import graph of every package's source.

The graph (grimp) holds every import statement of a module, those under `if TYPE_CHECKING:` and
inside functions included; the second test proves it on a copy of the source with an upward
import planted in each of those two forms.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".importlinter"
PACKAGES = ("lite-core", "lite-cuda", "lite-xla", "lite-deepspeed", "lite-torchft")
_LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(sources: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the packages whose `src` folders lie under `sources` (`<name>/src`)."""
    path = os.pathsep.join(str(sources / name / "src") for name in PACKAGES)
    return subprocess.run([sys.executable, "-c", _LINT, "--config", str(CONFIG), "--no-cache", "--no-logo"],
                          env={**os.environ, "PYTHONPATH": path}, cwd=sources, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.timeout(90)
def test_every_import_goes_down_the_layers() -> None:
    result = lint_imports(ROOT / "packages")
    assert result.returncode == 0, (
        "an import goes up the layers, or a module has no layer yet: give a new module its floor in .importlinter"
        f" (docs/architecture.md says which)\n{result.stdout}{result.stderr}")
    assert "0 broken" in result.stdout


@pytest.mark.timeout(90)
def test_an_upward_import_fails_even_under_type_checking_or_in_a_function(tmp_path: Path) -> None:
    for name in PACKAGES:
        shutil.copytree(ROOT / "packages" / name / "src", tmp_path / name / "src",
                        ignore=shutil.ignore_patterns("__pycache__"))
    ground = tmp_path / "lite-core" / "src" / "lite_core"
    with open(ground / "move.py", "a") as file:  # the ground names LightningLite for a type hint
        file.write("\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lite_core.lite import LightningLite\n")
    with open(ground / "checkpoint" / "_io.py", "a") as file:  # checkpoint code calls a strategy
        file.write("\n\ndef _planted():\n    from lite_core.strategies.ddp import DDPStrategy\n    return DDPStrategy\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lite_core.move -> lite_core.lite" in result.stdout
    assert "lite_core.checkpoint._io -> lite_core.strategies.ddp" in result.stdout
