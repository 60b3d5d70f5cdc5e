"""Fixtures of the matrix: `scenario_run(cell)` runs `scenario.py` once per cell and session.

The subprocess helpers are the shared ones of the repository's `conftest.py`:
a clean environment without launcher variables, `LITE_COLLECTIVE_TIMEOUT=20`, and a whole-job
kill when a run overruns its timeout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

HERE = Path(__file__).resolve().parent
# scenario.py, reference.py and cells.py import each other by name. Their folder goes right after
# the repository's own entry, not first: a test module's `from conftest import ...` means the
# repository's conftest.py, which this folder's conftest.py would otherwise shadow.
_ROOT = str(HERE.parents[1])
_AFTER_ROOT = next((i + 1 for i, entry in enumerate(sys.path) if os.path.abspath(entry or ".") == _ROOT), 0)
sys.path.insert(_AFTER_ROOT, str(HERE))

from cells import Cell  # noqa: E402
from checks import run_scenario  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every matrix test `matrix`, so environments can select the matrix with `-m`, and put
    it in the pytest-xdist group of the run it reads (`-n N --dist loadgroup`): the tests that
    share a cell's training run (its parity, failed save, evaluation and the checkpoint moves
    saved from it) go to one worker, so the run happens once."""
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.matrix)
            item.add_marker(pytest.mark.xdist_group(_run_group(item)))


def _run_group(item: pytest.Item) -> str:
    params = getattr(getattr(item, "callspec", None), "params", {})
    module = Path(item.path).stem
    if "resume" in params:
        return f"matrix:{params['resume'].saved_by.id}"
    cell = params.get("cell")
    if cell is None:
        return f"matrix:{module}"
    if module in ("test_matrix", "test_evaluation"):  # an evaluation cell not in the matrix gets a run of its own
        return f"matrix:{cell.id}"
    return f"matrix:{module}:{cell.id}"


@pytest.fixture(autouse=True)
def _planted_fault(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/mutants: `LITE_MUTANTS` (JSON, test id -> mutant folder) plants a fault in the runs of
    the tests it names (as `LITE_MUTANT`), so that one pytest checks several mutants."""
    folder = json.loads(os.environ.get("LITE_MUTANTS", "{}")).get(request.node.nodeid)
    if folder:
        monkeypatch.setenv("LITE_MUTANT", folder)


@pytest.fixture(scope="session")
def scenario_run(run_script: Callable[..., Any], output_of: Callable[..., str],
                 tmp_path_factory: pytest.TempPathFactory) -> Callable[[Cell], tuple[dict[str, Any], Path]]:
    """`scenario_run(cell)` -> (result, out_dir): a training run of `cell`, once per session, so
    that the parity test and the checkpoint moves share it."""
    done: dict[tuple[str, str | None], tuple[dict[str, Any], Path]] = {}

    def get(cell: Cell) -> tuple[dict[str, Any], Path]:
        key = cell.id, os.environ.get("LITE_MUTANT")  # a run with a planted fault is its own
        if key not in done:
            out_dir = tmp_path_factory.mktemp(cell.id)
            done[key] = run_scenario(run_script, output_of, cell, out_dir), out_dir
        return done[key]

    return get
