"""`lite run --max-restarts N`: a job that checkpoints every epoch and resumes at the top of
`run()` survives a rank's death; one that keeps failing ends after N restarts with the last
failure's traceback and exit code. The same jobs use torchrun's option names, `--log-dir`,
`--redirects` and `--tee` (torchrun's meaning: one folder per attempt and local rank)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

LITE_RUN = [sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu"]


def uninterrupted_weights() -> list[list[float]]:
    """What restart_job.py's 2 ranks compute without any failure, as one plain PyTorch loop: each
    step's global batch is the two ranks' batches of 4 together, and DDP averages their gradients."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    try:
        from restart_job import EPOCHS, data
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data().tensors
    for _ in range(EPOCHS):
        for start in range(0, len(x), 8):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[start:start + 8]), y[start:start + 8]).backward()
            optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def assert_each_rank_finished_like_an_uninterrupted_run(out_dir: Path) -> None:
    """Both ranks ran a second attempt and ended with the weights of a run that never failed."""
    expected = uninterrupted_weights()
    for rank in (0, 1):
        record = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert record["restart"] == "1"
        for got, want in zip(record["weight"], expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


def rank_log(logs: Path, attempt: int, local_rank: int, stream: str = "stdout") -> Path:
    """torchrun's layout: LOG_DIR/<run id>_<suffix>/attempt_<n>/<local rank>/<stream>.log."""
    (run,) = logs.iterdir()
    return run / f"attempt_{attempt}" / str(local_rank) / f"{stream}.log"


def test_a_restart_resumes_the_job_as_if_nothing_happened(run_script, marker, survivors, tmp_path, output_of):
    logs = tmp_path / "logs"
    proc = run_script(command=[*LITE_RUN, "--max-restarts", "1", "--nproc-per-node", "2", "--standalone",
                               "--log-dir", str(logs), "--redirects", "3", "restart_job.py", str(tmp_path), "exit"],
                      env={"LITE_TEST_JOB": marker})
    assert proc.returncode == 0, output_of(proc)
    assert proc.stderr.splitlines() == [
        f"lite run: local rank 1 failed with exit code 3 (its output is in {rank_log(logs, 0, 1).parent});"
        " stopping every rank.",
        "lite run: restarting every rank (restart 1 of 1).",
    ], output_of(proc)
    assert proc.stdout == ""  # the ranks' output went to their files only

    assert_each_rank_finished_like_an_uninterrupted_run(tmp_path)
    # Each attempt's output: epoch 0 before the failure, then epochs 1 and 2 after it.
    assert rank_log(logs, 0, 1).read_text().splitlines() == ["rank 1 finished epoch 0"]
    assert rank_log(logs, 1, 1).read_text().splitlines() == ["rank 1 finished epoch 1", "rank 1 finished epoch 2"]
    assert survivors(marker, 3.0) == []


def test_a_rank_that_fails_on_every_attempt_ends_the_job_after_the_last_restart(run_script, marker, survivors,
                                                                                 tmp_path, output_of):
    logs = tmp_path / "logs"
    proc = run_script(command=[*LITE_RUN, "--max-restarts", "1", "--devices", "2", "--log-dir", str(logs), "--tee", "3",
                               "restart_job.py", str(tmp_path), "sigkill-then-raise"],
                      env={"LITE_TEST_JOB": marker})
    assert proc.returncode == 1, output_of(proc)
    said = [line for line in proc.stderr.splitlines() if line.startswith("lite run: ")]
    assert said[:2] == [
        "lite run: local rank 1 failed with signal 9 (SIGKILL); stopping every rank.",
        "lite run: restarting every rank (restart 1 of 1).",
    ], output_of(proc)
    # Rank 0 fails too once its peer is gone; whichever exits first, rank 1 is blamed.
    assert len(said) == 3 and re.fullmatch(
        r"lite run: local rank 1 failed (with exit code 1|first \(its error is above\) and local rank 0 then ended"
        r" with exit code 1); stopping every rank\.", said[2]), output_of(proc)
    # The last failure's traceback is on the terminal (--tee) and in the rank's file.
    assert "RuntimeError: rank 1 fails again after the restart" in proc.stderr
    assert "RuntimeError: rank 1 fails again after the restart" in rank_log(logs, 1, 1, "stderr").read_text()
    assert "rank 0 finished epoch 0" in proc.stdout
    assert not list(tmp_path.glob("rank*.json"))
    assert survivors(marker, 3.0) == []


def test_plain_python_restarts_with_lite_max_restarts(run_script, marker, survivors, tmp_path, output_of):
    proc = run_script("restart_job.py", tmp_path, "exit", env={
        "LITE_TEST_JOB": marker, "LITE_MAX_RESTARTS": "1", "LITE_ACCELERATOR": "cpu", "LITE_STRATEGY": "ddp",
        "LITE_DEVICES": "2"})
    assert proc.returncode == 0, output_of(proc)
    said = [line for line in proc.stderr.splitlines() if line.startswith("lite: ")]
    assert said == ["lite: local rank 1 failed with exit code 3; stopping every rank.",
                    "lite: restarting every rank (restart 1 of 1)."], output_of(proc)
    assert_each_rank_finished_like_an_uninterrupted_run(tmp_path)
    assert survivors(marker, 3.0) == []
