"""Activation checkpointing under ddp, fsdp, model_parallel (FSDP2) and a 2-stage pipeline, on 2
processes over gloo, each against the same step without it (`tests/scripts/recompute_job.py`,
one start of the processes for every layout)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]  # hang guard: the job takes ~30 s idle

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "recompute_job.py"
_spec = importlib.util.spec_from_file_location("recompute_job", _SCRIPT)
job_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_module)

LAYOUTS = ("ddp", "fsdp", "model_parallel", "pipeline")


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute")
    proc = run_script(_SCRIPT, out, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return {**torch.load(out / "results.pt", weights_only=True), "out": out}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_those_without_recompute(job, layout) -> None:
    without, with_ = job[layout]["without"], job[layout]["with"]
    assert with_["grads"].keys() == without["grads"].keys() and len(without["grads"]) == 18
    for name, grad in without["grads"].items():
        torch.testing.assert_close(with_["grads"][name], grad, atol=1e-6, rtol=0, msg=name)
    assert with_["loss"] == pytest.approx(without["loss"], abs=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_blocks_forward_runs_again_in_backward(job, layout) -> None:
    without, with_ = job[layout]["without"], job[layout]["with"]
    if layout == "pipeline":  # rank 0 holds 2 blocks, run for 2 micro-batches (plus the stage's shape check)
        assert with_["calls"] == without["calls"] + 4
    else:
        assert (without["calls"], with_["calls"]) == (4, 8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_names_and_keys_are_the_users_model(job, layout) -> None:
    plain = job_module.Net()
    for run in job[layout].values():
        assert run["names"] == sorted(name for name, _ in plain.named_parameters())
        assert run["keys"] == sorted(plain.state_dict())


def test_a_checkpoint_saved_with_recompute_loads_without_it(job) -> None:
    saved = torch.load(job["out"] / "ddp.pt", weights_only=True)["model"]
    assert not any("_checkpoint_wrapped_module" in key for key in saved)
    plain = job_module.Net()
    plain.load_state_dict(saved)  # strict: plain PyTorch, no recompute
    for name, value in job["ddp"]["with"]["weights"].items():
        torch.testing.assert_close(plain.state_dict()[name], value, atol=0, rtol=0, msg=name)
    # fsdp's sharded checkpoint, loaded under ddp without recompute
    for name, value in job["fsdp"]["with"]["weights"].items():
        torch.testing.assert_close(job["loaded_from_fsdp_sharded"][name], value, atol=0, rtol=0, msg=name)
