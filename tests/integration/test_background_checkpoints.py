"""`save(..., blocking=False)` in 2-process jobs (`tests/scripts/background_save.py`): the
checkpoint holds the state of the moment of the call although training goes on meanwhile, and a
write that fails on rank 0 alone raises a CheckpointError on both ranks, at the next save and at
`wait_for_checkpoint()`. `ddp`, `ddp_spawn` (a spawned copy of Lite) and `fsdp` with
`state_dict_type="full"` write one file from a writer thread on rank 0; `fsdp` writes its shards
through torch distributed checkpoint's `async_save`, and so does `model_parallel`
(dp1 x tp2)."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "fsdp", "fsdp_full", "model_parallel"])
def test_background_save_keeps_the_state_of_the_call_and_every_rank_sees_a_failed_write(
        run_script, output_of, tmp_path, strategy):
    proc = run_script("background_save.py", strategy, tmp_path)
    assert proc.returncode == 0, output_of(proc)
    for rank in (0, 1):
        assert f"rank {rank} state at the call: True" in proc.stdout, output_of(proc)
        for when in ("save", "wait"):  # the ranks share stdout: one rank's line may run into the other's
            pattern = (rf"rank {rank} at {when}: Saving the checkpoint '[^']*broken' failed on rank 0"
                       r" with OSError \(\[Errno 28\] No space left on device\)")
            assert re.search(pattern, proc.stdout), output_of(proc)
