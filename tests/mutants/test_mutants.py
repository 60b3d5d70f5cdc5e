"""Planted faults that the matrix must catch.

Each mutant is a `sitecustomize.py` that the matrix loads into every process of a scenario run
(`LITE_MUTANT` puts its folder on the run's `PYTHONPATH`; the plain PyTorch reference, computed
in the test process, stays intact). The cells that should notice it run in a pytest of its own;
if they pass, the mutant survived, and this test fails naming it.

Mutants whose matrix tests differ share one such pytest (`LITE_MUTANTS` tells the matrix which
test gets which fault, and a faulty run is never reused by another test): 2 pytest starts, each
importing torch and collecting the matrix, instead of one per mutant. Each listed test must fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable

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

#: Seconds one pytest of several mutants may take (each of its tests runs one or two scenario runs).
_ROUND_TIMEOUT = 540

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(_ROUND_TIMEOUT + 60)]


def rounds() -> list[dict[str, str]]:
    """The mutants grouped into pytest runs, each `{matrix test: mutant}`: a test appears at most
    once per run, so mutants that share a test go into different runs."""
    grouped: list[dict[str, str]] = []
    for mutant in sorted(MUTANTS):
        tests = MUTANTS[mutant][1]
        group = next((g for g in grouped if not set(tests) & set(g)), None)
        if group is None:
            group = {}
            grouped.append(group)
        group.update(dict.fromkeys(tests, mutant))
    return grouped


def _junit_outcomes(report: Path) -> dict[str, str]:
    """`{test id: passed | failed | error | skipped}` of a JUnit report written from ROOT."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{path}::{case.get('name')}"] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return outcomes


def _run_round(planted: dict[str, str], report: Path) -> tuple[dict[str, str], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "LITE_MUTANT")}  # keep the suite's report ours
    env["LITE_MUTANTS"] = json.dumps({test: str(HERE / mutant) for test, mutant in planted.items()})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
                           f"--junitxml={report}", *planted], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=_ROUND_TIMEOUT)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return (_junit_outcomes(report) if report.is_file() else {}), summary


@pytest.fixture(scope="module")
def outcome_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict[str, str], str]]:
    """`outcome_of(mutant)` -> ({its matrix test: outcome}, that pytest's summary line); each
    round of mutants runs once, when the first of its mutants is asked for."""
    done: dict[int, tuple[dict[str, str], str]] = {}
    grouped = rounds()

    def get(mutant: str) -> tuple[dict[str, str], str]:
        number = next(i for i, group in enumerate(grouped) if mutant in group.values())
        if number not in done:
            done[number] = _run_round(grouped[number], tmp_path_factory.mktemp(f"mutants-{number}") / "report.xml")
        outcomes, summary = done[number]
        return {test: outcomes.get(test, "not run") for test in MUTANTS[mutant][1]}, summary

    return get


def test_mutants_share_pytest_runs_without_sharing_a_test() -> None:
    grouped = rounds()
    assert sorted(mutant for group in grouped for mutant in set(group.values())) == sorted(MUTANTS)
    assert len(grouped) == 2  # no_grad_sync and no_sampler both break ddp-2-32-true's training test


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_matrix_catches_the_planted_fault(mutant: str, outcome_of: Callable[..., tuple[dict[str, str], str]]) -> None:
    what, _ = MUTANTS[mutant]
    outcomes, summary = outcome_of(mutant)
    assert set(outcomes.values()) != {"passed"}, (
        f"mutant '{mutant}' survived: the matrix passed although {what} ({summary})")
    assert set(outcomes.values()) == {"failed"}, f"mutant '{mutant}': the matrix did not run: {outcomes} ({summary})"
