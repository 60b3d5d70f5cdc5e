"""The suite's two pytest-xdist workers take whole groups (`--dist loadgroup`): a module's tests
run on one worker, so its module-scoped job runs once, and the matrix tests that read one cell's
training run (its parity and accumulation tests, the checkpoint moves saved from it) run on one
worker, so that run happens once. When grouping stops working every test still passes and only
the time grows, so it is checked here. It has stopped twice: the root conftest's hook ran after
xdist's, and pytest 9.2 keeps node ids where xdist 3.8 no longer writes the group."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="the test environments install pytest-xdist (hatch.toml)")

ROOT = Path(__file__).resolve().parents[2]

#: A plugin for the inner pytest: each worker appends `worker node-id` for every test it starts.
RECORDER = '''
import os

def pytest_runtest_logstart(nodeid, location):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        with open(os.environ["WORKERS_RECORD"], "a") as record:
            record.write(f"{worker} {nodeid.split('@')[0]}\\n")
'''


def workers_by_test(tmp_path: Path, *selection: str) -> dict[str, str]:
    (tmp_path / "record_worker.py").write_text(RECORDER)
    record = tmp_path / "workers.txt"
    # --setup-plan: xdist schedules and starts every test, but no fixture runs (no training job).
    command = [sys.executable, "-m", "pytest", "-p", "record_worker", "-p", "no:cacheprovider", "-q",
               "-n", "2", "--dist", "loadgroup", "--setup-plan", *selection]
    env = {**_environ(), "PYTHONPATH": str(tmp_path), "WORKERS_RECORD": str(record)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return dict(reversed(line.split(" ", 1)) for line in record.read_text().splitlines())


def _environ() -> dict[str, str]:
    # Without the suite's PYTEST_ADDOPTS: its --junitxml report is the outer pytest's.
    return {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}


@pytest.mark.timeout(150)
def test_a_modules_tests_and_a_matrix_cells_tests_each_run_on_one_worker(tmp_path):
    ran = workers_by_test(tmp_path, "packages/lite-core/tests/test_connector.py", "tests/matrix/test_matrix.py",
                          "tests/matrix/test_checkpoint_matrix.py", "-k", "test_connector or ddp-2-32-true")
    groups: dict[str, set[str]] = defaultdict(set)
    for test, worker in ran.items():
        if test.startswith("packages/lite-core/tests/test_connector.py"):
            groups["test_connector.py"].add(worker)
        elif "[ddp-2-32-true" in test:  # the cell's own tests and the moves it saved
            groups["matrix:ddp-2-32-true"].add(worker)
    assert len([t for t in ran if "test_connector" in t]) > 10 and len([t for t in ran if "[ddp-2-32-true" in t]) >= 4
    assert {group: len(workers) for group, workers in groups.items()} == {
        "test_connector.py": 1, "matrix:ddp-2-32-true": 1}, dict(groups)
