"""A failing rank must end the whole 2-process job quickly, show its traceback and leave no process.

`tests/scripts/failing.py` makes one rank fail while the other blocks in an all_reduce that can
never complete. Without teardown the survivor would wait for Lite's collective timeout (20 s in
these tests), so "quickly" means well under that. Measured on 2 shared CPU cores: every job ends
0.05-2 s after the failure and 3-7.5 s after it started (ddp_spawn being the slowest).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: Seconds between the failure and the end of the whole job (the collective timeout is 20 s).
MAX_SECONDS_AFTER_FAILURE = 10.0
#: Seconds for the whole job, start-up of both ranks included.
MAX_SECONDS_IN_ALL = 45.0  # start-up only; the bound that proves "no hang" is the one above


def run_failing(run_script, strategy: str, mode: str, out_dir: Path):
    started = time.time()
    proc = run_script("failing.py", strategy, mode, out_dir)
    ended = time.time()
    failed_at = float((out_dir / "failed_at").read_text())
    pids = [int((out_dir / f"pid_rank{r}").read_text()) for r in (0, 1)]
    return proc, ended - failed_at, ended - started, pids


def check_ended(proc, after_failure, in_all, pids, out_dir, wait_gone, output_of):
    assert proc.returncode != 0, output_of(proc)
    assert "UNEXPECTED" not in proc.stdout, output_of(proc)
    assert not list(out_dir.glob("survived_rank*")), "the surviving rank's collective returned"
    assert after_failure < MAX_SECONDS_AFTER_FAILURE, f"job ended {after_failure:.1f} s after the failure"
    assert in_all < MAX_SECONDS_IN_ALL, f"job took {in_all:.1f} s"
    assert wait_gone(pids, 3.0) == [], f"processes left running after the job ended: {output_of(proc)}"


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork"])
def test_rank_one_raising_ends_the_job(strategy, run_script, tmp_path, wait_gone, output_of):
    proc, after_failure, in_all, pids = run_failing(run_script, strategy, "raise1", tmp_path)
    check_ended(proc, after_failure, in_all, pids, tmp_path, wait_gone, output_of)
    # The cause must be visible, not only the survivor's "connection closed" error.
    assert "RuntimeError: boom on rank 1" in proc.stderr, output_of(proc)


def test_rank_zero_raising_under_ddp_stops_the_child(run_script, tmp_path, wait_gone, output_of):
    proc, after_failure, in_all, pids = run_failing(run_script, "ddp", "raise0", tmp_path)
    check_ended(proc, after_failure, in_all, pids, tmp_path, wait_gone, output_of)
    assert "RuntimeError: boom on rank 0" in proc.stderr, output_of(proc)
    # Python's exit code for an uncaught exception; rank 1 was stopped by Lite, it did not fail.
    assert proc.returncode == 1, output_of(proc)
    assert "local rank 1 failed" not in proc.stderr, output_of(proc)


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_rank_calling_os_exit_under_ddp(failing_rank, run_script, tmp_path, wait_gone, output_of):
    proc, after_failure, in_all, pids = run_failing(run_script, "ddp", f"exit{failing_rank}", tmp_path)
    check_ended(proc, after_failure, in_all, pids, tmp_path, wait_gone, output_of)
    assert proc.returncode == 3, output_of(proc)  # the failing rank's exit code is the job's
    if failing_rank == 1:
        assert "local rank 1 failed with exit code 3" in proc.stderr, output_of(proc)


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_rank_raising_after_launch_without_function_ends_the_job(failing_rank, run_script, tmp_path, wait_gone,
                                                                 output_of):
    proc, after_failure, in_all, pids = run_failing(run_script, "ddp", f"launch-raise{failing_rank}", tmp_path)
    check_ended(proc, after_failure, in_all, pids, tmp_path, wait_gone, output_of)
    assert f"RuntimeError: boom on rank {failing_rank}" in proc.stderr, output_of(proc)
