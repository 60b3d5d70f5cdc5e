"""Planted faults that the matrix must catch.

Each mutant is a `sitecustomize.py` that the matrix loads into every process of a scenario run
(`LITE_MUTANT` puts its folder on the run's `PYTHONPATH`; the plain PyTorch reference, computed
in the test process, stays intact). The cells that should notice it run in a pytest of their own;
if they all pass, the mutant survived, and this test fails naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_TRAIN = "tests/matrix/test_matrix.py::test_training_matches_plain_pytorch"
_RESUME = "tests/matrix/test_checkpoint_matrix.py::test_resume_under_another_strategy"
_EVALUATE = "tests/matrix/test_evaluation.py::test_evaluation_equals_one_process"
_FIDELITY = "tests/matrix/test_fidelity.py::test_the_set_up_model_behaves_as_the_plain_model"

#: mutant -> (what it breaks, the matrix tests that must fail with it)
MUTANTS = {
    "autocast_off": ("autocast does nothing", [f"{_TRAIN}[single_device-1-bf16-mixed]"]),
    "strategy_swap": ("ddp_spawn silently runs as ddp", [f"{_TRAIN}[ddp_spawn-2-32-true]"]),
    "no_grad_sync": ("gradients are not all-reduced", [f"{_TRAIN}[ddp-2-32-true]"]),
    "no_sampler": ("the distributed sampler is not injected", [f"{_TRAIN}[ddp-2-32-true]"]),
    "eval_padding": ("evaluation passes are padded like training ones", [f"{_EVALUATE}[ddp-2-32-true]"]),
    "no_optimizer_restore": ("a checkpoint loads the model but not the optimizer",
                             [f"{_RESUME}[ddp-2-32-true-to-single_device-1-32-true]"]),
    "prefixed_names": ("the set-up model's parameter names carry a prefix",
                       [f"{_FIDELITY}[single_device-1-32-true-named_parameters]"]),
    "writes_stop_at_wrapper": ("attribute writes on the set-up model never reach forward",
                               [f"{_FIDELITY}[single_device-1-32-true-attribute]"]),
}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_matrix_catches_the_planted_fault(mutant: str) -> None:
    what, tests = MUTANTS[mutant]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # keep the suite's report ours
    env["LITE_MUTANT"] = str(HERE / mutant)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    assert proc.returncode != 0, f"mutant '{mutant}' survived: the matrix passed although {what} ({summary})"
    assert proc.returncode == 1 and " failed" in summary, f"mutant '{mutant}': the matrix did not run: {summary}"
