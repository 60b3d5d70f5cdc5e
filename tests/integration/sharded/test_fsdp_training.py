"""`fsdp` on 2 real processes over gloo: parity with one plain PyTorch process, gradient
accumulation with `no_backward_sync`, clipping under sharding, `empty_init` on meta, and the
collectives a user's loop calls."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def fsdp_job(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    proc = run_script("sharded_train.py", "fsdp", out_dir)
    assert proc.returncode == 0, output_of(proc)
    job = torch.load(out_dir / "training.pt", weights_only=True)
    job["user_collectives"] = {rank: json.loads((out_dir / f"user_collectives_rank{rank}.json").read_text())
                               for rank in (0, 1)}
    return job


def test_collectives_of_python_numbers_containers_and_mismatched_shapes(fsdp_job, check_user_collectives):
    check_user_collectives(fsdp_job["user_collectives"])


def test_fsdp_with_clipping_matches_plain_pytorch(fsdp_job, reference):
    expected, norms = reference.plain_pytorch(fsdp_job, "clipped", batch=4, accumulate=1, clip=True)
    reference.assert_weights_match(fsdp_job["clipped_final"], expected, fsdp_job["clipped_initial"])
    torch.testing.assert_close(torch.tensor(fsdp_job["clipped_norms"]), torch.tensor(norms), atol=1e-5, rtol=0)
    assert all(n > 0.3 for n in norms), "clipping never happened; the comparison would prove nothing"


def test_fsdp_accumulation_with_no_backward_sync_matches_plain_pytorch(fsdp_job, reference):
    expected, _ = reference.plain_pytorch(fsdp_job, "accumulated", batch=2, accumulate=2, clip=False)
    assert fsdp_job["accumulated_unreduced"] == [True] * 4, "a backward inside no_backward_sync reduced gradients"
    reference.assert_weights_match(fsdp_job["accumulated_final"], expected, fsdp_job["accumulated_initial"])


def test_empty_init_builds_on_meta_and_equals_a_normal_build(fsdp_job, reference):
    assert fsdp_job["empty_on_meta"], "init_module(empty_init=True) allocated real parameters"
    # Each process holds only its shard: half the rows of the first layer's weight (16 x 4).
    assert fsdp_job["empty_local_numel"]["0.weight"] == 32
    torch.manual_seed(7)
    normal = reference.make_model().state_dict()
    assert fsdp_job["empty_final"].keys() == normal.keys()
    for name, tensor in normal.items():
        assert torch.equal(fsdp_job["empty_final"][name], tensor), name
    # Buffers written in __init__ are computed, not left to reset_parameters() (there is none).
    assert torch.equal(fsdp_job["empty_buffers"]["mask"], torch.ones(4, 4).tril())
    assert torch.equal(fsdp_job["empty_buffers"]["scale"], torch.full((4,), 3.0))


def test_an_optimizer_without_state_round_trips_through_full_and_sharded_checkpoints(fsdp_job):
    # SGD without momentum keeps no per-parameter state, stepped or not: torch's full-state load
    # found no tensor to take the device of the shards from and failed.
    found = fsdp_job["stateless_round_trips"]
    assert set(found) == {f"sgd_{kind}_{when}" for kind in ("full", "sharded") for when in ("stepped", "unstepped")}
    for name, loaded in found.items():
        assert loaded == {"lr": 0.05, "state": 0, "weights_equal": True}, name


def test_a_full_state_dict_taken_before_a_step_keeps_what_it_held(fsdp_job):
    # On a CPU torch's gathered state dict holds the buffers' own memory (they are not sharded):
    # a user's `best = lite.full_state_dict(model)` followed them through training.
    assert fsdp_job["snapshot_lost"] == [], "full_state_dict handed out the model's own tensors"
    assert fsdp_job["snapshot_unchanged"] == [], "the step changed nothing: the check proves nothing"


def test_fsdp_misuse_bf16_mixed_cpu_offload_setup_with_optimizer_and_position_keyed_loading(run_script, output_of):
    proc = run_script("fsdp_single_process.py")
    assert proc.returncode == 0, output_of(proc)
    for check in ("full_state_dict is a copy", "setup(model, optimizer)", "checkpoints across setup styles", "optimizer of unsharded parameters",
                  "empty_init without reset_parameters", "bf16-mixed", "cpu_offload",
                  "position-keyed checkpoint", "hostile metadata"):
        assert f"OK {check}" in proc.stdout, output_of(proc)
