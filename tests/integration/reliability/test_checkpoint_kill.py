"""A 2-process `ddp` job killed (SIGKILL) while rank 0 writes a checkpoint (in the foreground, or
in the background writer of `save(..., blocking=False)`) leaves the previous checkpoint whole: it
loads, with the weights of the first save; the next save removes the temporary file the killed
one left behind."""

from __future__ import annotations

import signal
import sys

import pytest
import torch
from torch import nn

from lite_core import LightningLite

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_kill_during_save_in_a_ddp_job_keeps_the_previous_checkpoint(run_script, marker, survivors, tmp_path,
                                                                     output_of, mode):
    path = tmp_path / "ckpt.pt"
    proc = run_script(command=[sys.executable, "save_and_die.py", str(path), mode], env={"LITE_TEST_JOB": marker})
    assert proc.returncode == -signal.SIGKILL, output_of(proc)  # rank 0, the launching process, was killed
    assert "UNEXPECTED" not in proc.stdout
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the second save never started writing"
    assert survivors(marker, 3.0) == [], output_of(proc)

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"version": 0, "model": model, "optimizer": optimizer}
    LightningLite(accelerator="cpu").load(path, state)
    assert state["version"] == 1
    expected = torch.load(tmp_path / "ckpt.pt.expected.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)

    LightningLite(accelerator="cpu").save(state, path)  # the killed writer's temporary file goes
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
