"""A user's own `DTensor`s in `save` content under `fsdp` (`tests/scripts/dtensor_content.py`, 2
processes): an average of the set-up model's parameters kept in a plain dict, and a list holding
one, are saved whole through torch distributed checkpoint, loaded back into the same `DTensor`s,
read whole by `load(path)`, and loaded under `ddp` as whole tensors. Before, rank 0 wrote its own
shards of them beside the checkpoint, and every rank loaded rank 0's shards."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]  # hang guard: the job takes ~10 s idle


@pytest.fixture(scope="module")
def ranks(run_script, output_of, tmp_path_factory):
    out = tmp_path_factory.mktemp("dtensor_content")
    proc = run_script("dtensor_content.py", out, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_values_of_the_users_own_come_back_into_the_same_dtensors(ranks, rank) -> None:
    result = ranks[rank]
    assert _equal(result["loaded"], result["saved"])
    assert torch.equal(result["loaded_history"], result["saved_history"])
    assert result["kept_objects"] and result["step"] == 7


@pytest.mark.parametrize("rank", [0, 1])
def test_they_are_read_whole_without_state_and_under_ddp(ranks, rank) -> None:
    result = ranks[rank]
    assert _equal(result["whole"], result["saved"]) and result["whole_step"] == 7
    assert _equal(result["under_ddp"], result["saved"])
    assert torch.equal(result["under_ddp_history"], result["saved_history"])


def test_a_full_checkpoint_holds_them_whole_for_a_plain_process(ranks) -> None:
    # Before, rank 0 pickled its DTensor shards into the one file (weights_only refuses those).
    files = ranks[0]["in_one_file"]
    assert set(files) == {"full", "full-background"}  # save(), and save(blocking=False)
    for which, ema in files.items():
        for name, (kind, value) in ema.items():
            assert kind == "Tensor", (which, name)
            assert torch.equal(value, ranks[0]["saved"][name]), (which, name)
