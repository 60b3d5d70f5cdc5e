"""The suite's matrix summary: read each environment's JUnit report, one row per matrix cell."""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

_SUITE = Path(__file__).resolve().parents[2] / "tools" / "test_suite.py"
_spec = importlib.util.spec_from_file_location("_lite_test_suite", _SUITE)
assert _spec is not None and _spec.loader is not None
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

_REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.matrix.test_matrix" name="test_training_matches_plain_pytorch[ddp-2-32-true]@matrix:ddp-2-32-true" time="9"/>
<testcase classname="tests.matrix.test_matrix" name="test_training_matches_plain_pytorch[deepspeed_stage_3-2-32-true]" time="0">
  <skipped type="pytest.skip" message="needs lite-deepspeed, not installed in this environment">skip</skipped></testcase>
<testcase classname="tests.matrix.test_matrix" name="test_training_matches_plain_pytorch[tpu-xla_fsdp-2-32-true]" time="5">
  <skipped type="pytest.xfail" message="known parity gap">xfail</skipped></testcase>
<testcase classname="tests.matrix.test_checkpoint_matrix" name="test_resume_under_another_strategy[fsdp-2-32-true-to-ddp-2-32-true]" time="5">
  <failure message="AssertionError: losses after resuming&#10;second line">trace</failure></testcase>
<testcase classname="packages.lite-core.tests.test_registry" name="test_not_a_matrix_test" time="7"/>
</testsuite></testsuites>"""


def test_outcomes_of_matrix_tests_only(tmp_path: Path) -> None:
    # The first case ran on a pytest-xdist worker under --dist loadgroup, which appends its group.
    report = tmp_path / "test.xml"
    report.write_text(_REPORT)
    outcomes = suite.matrix_outcomes(report)
    assert outcomes == {
        "test_training_matches_plain_pytorch[ddp-2-32-true]": ("passed", ""),
        "test_training_matches_plain_pytorch[deepspeed_stage_3-2-32-true]":
            ("skipped", "needs lite-deepspeed, not installed in this environment"),
        "test_training_matches_plain_pytorch[tpu-xla_fsdp-2-32-true]": ("xfail", "known parity gap"),
        "test_resume_under_another_strategy[fsdp-2-32-true-to-ddp-2-32-true]":
            ("FAILED", "AssertionError: losses after resuming"),
    }
    assert suite.matrix_outcomes(tmp_path / "missing.xml") == {}  # an environment that never ran pytest
    assert suite.matrix_seconds(report) == 19  # the non-matrix test's time is not counted


def test_table_has_a_row_per_cell_a_column_per_environment_and_numbered_reasons(tmp_path: Path) -> None:
    report = tmp_path / "test.xml"
    report.write_text(_REPORT)
    outcomes = {"test": suite.matrix_outcomes(report),
                "test-deepspeed": {"test_training_matches_plain_pytorch[deepspeed_stage_3-2-32-true]": ("passed", "")},
                "test-packaging": {}}  # runs no matrix test: no column
    lines = suite.matrix_table(outcomes)
    assert lines[0] == "| matrix cell | test | test-deepspeed |"
    assert "| train ddp-2-32-true | passed | not run |" in lines
    assert "| train deepspeed_stage_3-2-32-true | skipped [1] | passed |" in lines
    assert "| resume fsdp-2-32-true-to-ddp-2-32-true | FAILED [3] | not run |" in lines
    assert lines[-3:] == ["[1] needs lite-deepspeed, not installed in this environment",
                          "[2] known parity gap", "[3] AssertionError: losses after resuming"]


def test_a_cell_that_ran_nowhere_fails_the_suite_unless_it_needs_absent_hardware() -> None:
    declared = {"test_training_matches_plain_pytorch[ddp-2-32-true]": False,
                "test_training_matches_plain_pytorch[fsdp-2-32-true]": False,
                "test_training_matches_plain_pytorch[tpu-xla-2-32-true]": False,
                "test_training_matches_plain_pytorch[cuda-ddp-2-32-true]": True}
    outcomes = {
        "test": {"test_training_matches_plain_pytorch[ddp-2-32-true]": ("passed", ""),
                 "test_training_matches_plain_pytorch[tpu-xla-2-32-true]": ("skipped", "runs in `test-xla`"),
                 "test_training_matches_plain_pytorch[cuda-ddp-2-32-true]": ("skipped", "needs 2 CUDA device(s)")},
        "test-xla": {"test_training_matches_plain_pytorch[tpu-xla-2-32-true]": ("skipped", "needs torch-xla")},
    }
    refused, excused = suite.unrun_tests(outcomes, declared)
    assert refused == ["train fsdp-2-32-true: deselected or not collected",
                       "train tpu-xla-2-32-true: needs torch-xla; runs in `test-xla`"]
    assert excused == ["train cuda-ddp-2-32-true: needs 2 CUDA device(s)"]


def test_every_declared_matrix_test_is_known_with_its_hardware_need() -> None:
    declared = suite.matrix_tests()
    assert declared["test_training_matches_plain_pytorch[ddp-2-32-true]"] is False
    assert declared["test_training_matches_plain_pytorch[tpu-xla-2-32-true]"] is False  # XLA runs on the CPU here
    assert declared["test_a_failed_save_raises_on_every_rank[deepspeed_stage_3-2-32-true]"] is False
    assert declared["test_gradient_accumulation_matches_plain_pytorch[tpu-xla-2-32-true]"] is False  # must run somewhere
    assert any(name.startswith("test_resume_under_another_strategy[") for name in declared)
    cuda = [name for name in declared if "cuda-" in name]
    has_gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
    assert cuda and all(declared[name] is not has_gpu for name in cuda)  # excused only without a GPU


def test_environments_that_mostly_wait_run_in_a_lane_beside_the_others(monkeypatch, capsys) -> None:
    # `hatch run ENV:all` is replaced by a job that takes 0.3 s; `hatch env create` by nothing.
    import subprocess
    import threading
    import time

    spans: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    def fake_run(command, **kwargs):
        return subprocess.CompletedProcess(command, 0)

    def fake_hatch_run(command, env, output):
        started = time.monotonic()
        time.sleep(0.3)
        with lock:
            spans[command[2].removesuffix(":all")] = (started, time.monotonic())
        if output is not None:
            output.write(f"{command[2]} output\n")
        return 0, 0.0

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    monkeypatch.setattr(suite, "run_with_cpu", fake_hatch_run)
    asked = ["test", "test-ray", "test-xla", "test-packaging"]
    assert suite.main(asked) == 0
    assert set(spans) == set(asked)
    (test_start, test_end), (xla_start, _) = spans["test"], spans["test-xla"]
    (packaging_start, packaging_end), (ray_start, _) = spans["test-packaging"], spans["test-ray"]
    assert xla_start >= test_end  # the others one after the other
    assert packaging_start < test_end and test_start < packaging_end  # the lane beside them
    assert ray_start >= packaging_end  # one after another in the lane
    out = capsys.readouterr().out
    assert "===== test-packaging (ran beside the others) =====\ntest-packaging:all output" in out
    assert "===== test-ray (ran beside the others) =====\ntest-ray:all output" in out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| test")]
    assert rows == ["| test", "| test-ray", "| test-xla", "| test-packaging"]  # the table in the order asked


def test_an_environments_cpu_seconds_include_its_grandchildren(tmp_path: Path) -> None:
    # A child starts a grandchild that burns CPU and writes its own CPU-seconds; the child's
    # resource usage (what the suite's table reports per environment) must include them.
    import os
    import sys

    burn = ("import time\nx = 0\nfor i in range(3_000_000): x += i * i\n"
            "print(time.process_time())")
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    with (tmp_path / "out.txt").open("w") as output:
        # Real process trees (the fork server's programs are its own children, not the test's).
        fresh = {**os.environ, "LITE_TEST_FORKSERVER": "0"}
        code, cpu = suite.run_with_cpu([sys.executable, "-c", parent], fresh, output)
    assert code == 0
    grandchild_cpu = float((tmp_path / "out.txt").read_text().split()[-1])
    assert grandchild_cpu > 0
    assert cpu >= grandchild_cpu
