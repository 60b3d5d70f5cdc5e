"""Every cell of the matrix trains `scenario.py` and lands where one plain PyTorch process does.

Run one cell alone with `-k`, e.g. `hatch run test-deepspeed:matrix -k deepspeed_stage_3-2`.
"""

from __future__ import annotations

from typing import Any

import pytest

from cells import CELLS, Cell, skip_reason
from checks import assert_close, assert_ran_as, assert_weights_close
from reference import plain_run
from scenario import ACCUMULATE, ACCUMULATED_STEPS, STEPS


def _param(cell: Cell) -> Any:
    marks = [pytest.mark.timeout(cell.timeout + 30)]
    if cell.devices > 1:
        marks.append(pytest.mark.multiprocess)
    if cell.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=cell.xfail))
    reason = skip_reason(cell)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(cell, marks=marks, id=cell.id)


@pytest.mark.parametrize("cell", [_param(cell) for cell in CELLS])
def test_training_matches_plain_pytorch(cell: Cell, scenario_run: Any) -> None:
    result, _ = scenario_run(cell)
    plain = plain_run(cell.precision, cell.devices)
    assert_ran_as(cell, result)
    assert len(result["losses"]) == STEPS
    assert_close(result["losses"], plain["losses"], cell.tolerance, "losses")
    assert_weights_close(result["weights"], plain["weights"], cell.tolerance)
    moved = max(abs(a - b) for name in plain["weights"]
                for a, b in zip(plain["weights"][name], plain["initial"][name]))
    assert moved > 10 * cell.tolerance, "training barely moved the weights: the comparison would prove nothing"


@pytest.mark.parametrize("cell", [_param(cell) for cell in CELLS])
def test_gradient_accumulation_matches_plain_pytorch(cell: Cell, scenario_run: Any) -> None:
    # Same run as above: after training, docs/convert.md's accumulation loop (`no_backward_sync`
    # on every micro-batch but the step's last) goes on from the trained weights. On one process
    # no_backward_sync does nothing; on several, a step that skips the last all-reduce leaves the
    # ranks apart, and one that all-reduces every micro-batch adds the gradients in another order.
    result, _ = scenario_run(cell)
    plain = plain_run(cell.precision, cell.devices)
    assert len(result["accumulated_losses"]) == ACCUMULATE * ACCUMULATED_STEPS
    assert_close(result["accumulated_losses"], plain["accumulated_losses"], cell.tolerance, "accumulated losses")
    assert_weights_close(result["accumulated_weights"], plain["accumulated_weights"], cell.tolerance)
    moved = max(abs(a - b) for name in plain["weights"]
                for a, b in zip(plain["accumulated_weights"][name], plain["weights"][name]))
    assert moved > 10 * cell.tolerance, "accumulation barely moved the weights: the comparison would prove nothing"


@pytest.mark.parametrize("cell", [_param(cell) for cell in CELLS])
def test_a_failed_save_raises_on_every_rank(cell: Cell, scenario_run: Any) -> None:
    # Same run as above. Before: under DeepSpeed and xla only the writing rank raised and the
    # others waited in the save's barrier until the launcher ended the job.
    failed = scenario_run(cell)[0]["failed_save"]
    assert failed["raised"] == ["CheckpointError"] * cell.devices, failed
    assert "failed on rank 0 with" in failed["message"] and "lambda" in failed["message"], failed["message"]
