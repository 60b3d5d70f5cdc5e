"""Save under one strategy and process count, resume under another.

Each source run is the cell's own training run (it saves after SAVE_AT steps); the resumed run
starts from other weights, loads the checkpoint and trains the remaining steps, which must equal
the uninterrupted run's. A move that Lite refuses by design must fail with its one sentence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cells import EXACT, RESUMES, Resume, resume_skip_reason
from checks import assert_close, assert_weights_close, run_scenario
from reference import plain_run
from scenario import SAVE_AT, STEPS

pytestmark = pytest.mark.multiprocess


def _param(resume: Resume) -> Any:
    timeout = resume.saved_by.timeout + resume.resumed_by.timeout + 30
    marks = [pytest.mark.timeout(timeout)]
    reason = resume_skip_reason(resume)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(resume, marks=marks, id=resume.id)


@pytest.mark.parametrize("resume", [_param(resume) for resume in RESUMES])
def test_resume_under_another_strategy(resume: Resume, scenario_run: Any, run_script: Any, output_of: Any,
                                       tmp_path: Path) -> None:
    saved, source_dir = scenario_run(resume.saved_by)
    result = run_scenario(run_script, output_of, resume.resumed_by, tmp_path, "--resume", source_dir / "checkpoint")
    if resume.refused is not None:
        message = result.get("error", "")
        assert resume.refused in message, result
        assert "\n" not in message and message.endswith("."), message
        return
    assert "error" not in result, result["error"]
    assert result["resumed_at"] == SAVE_AT and len(result["losses"]) == STEPS - SAVE_AT
    tolerance = max(resume.saved_by.tolerance, resume.resumed_by.tolerance, EXACT)  # strategies mixed
    assert_close(result["losses"], saved["losses"][SAVE_AT:], tolerance, "losses after resuming")
    assert_weights_close(result["weights"], saved["weights"], tolerance)
    assert_weights_close(result["weights"], plain_run()["weights"], tolerance)
