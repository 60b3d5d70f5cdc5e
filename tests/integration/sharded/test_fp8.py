"""FP8 through torchao (emulated) under ddp, fsdp and model_parallel (tensor parallel; a 2-stage
pipeline) on 2 processes over gloo, each against the same parallel loop written by hand with
torchao's conversion applied by hand (the pipeline against one plain process)
(`tests/scripts/fp8_job.py`, one start of the processes for every case). FP8 is compared with
FP8, never with float32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="needs lite-core[fp8] (torchao), which the test environment installs")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]  # hang guard: the job takes ~40 s idle

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fp8_job.py"
RECIPES = ("tensorwise", "rowwise")


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    proc = run_script(_SCRIPT, out, timeout=480, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out / "results.pt", weights_only=True)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_trains_bitwise_as_the_same_loop_converted_by_hand(job, layout, recipe) -> None:
    lite, by_hand = job[f"lite/{layout}/{recipe}"], job[f"by_hand/{layout}/{recipe}"]
    assert lite["losses"] == by_hand["losses"]
    assert largest_difference(lite["weights"], by_hand["weights"]) == 0.0


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp_all_gathers_weights_in_float8_where_the_recipe_allows_it(job, recipe) -> None:
    # torchao's float8 all-gather has the tensorwise recipe only; the bitwise test above compares
    # it with fully_shard over a model converted by hand with enable_fsdp_float8_all_gather=True.
    assert job[f"lite/fsdp/{recipe}"]["float8_all_gather"] is (recipe == "tensorwise")
    assert job[f"lite/ddp/{recipe}"]["float8_all_gather"] is False


def test_rowwise_scales_do_not_depend_on_how_the_batch_is_split_but_tensorwise_scales_do(job) -> None:
    # Around the FP8 matmuls in float32: 2 processes on 16 samples each against one on all 32.
    rowwise = largest_difference(job["lite/ddp/rowwise/fp32"]["weights"], job["one_process/rowwise"]["weights"])
    tensorwise = largest_difference(job["lite/ddp/tensorwise/fp32"]["weights"],
                                    job["one_process/tensorwise"]["weights"])
    assert rowwise < 1e-6  # float32 rounding (3e-8 measured)
    assert tensorwise > 1e-4  # each process's own amax scales its activations (1e-3 measured)


def test_a_pipeline_trains_rowwise_fp8_as_one_plain_process(job) -> None:
    # Micro-batches do not change rowwise scales: 2 stages, 2 micro-batches, float32 around the matmuls.
    pipeline = job["lite/pipeline/rowwise/fp32"]
    assert largest_difference(pipeline["weights"], job["one_process/rowwise"]["weights"]) < 1e-6
    assert pipeline["losses"] == pytest.approx(job["one_process/rowwise"]["losses"], abs=1e-6)


def test_a_checkpoint_saved_in_fp8_loads_in_bf16_and_the_reverse(job) -> None:
    assert largest_difference(job["moved/fp8_saved"]["weights"], job["moved/fp8_to_bf16"]["weights"]) == 0.0
    assert largest_difference(job["moved/bf16_saved"]["weights"], job["moved/bf16_to_fp8"]["weights"]) == 0.0
    # The two saved runs differ (FP8 against bf16), so each load really replaced the weights.
    assert largest_difference(job["moved/fp8_saved"]["weights"], job["moved/bf16_saved"]["weights"]) > 1e-4


def test_a_checkpoint_of_float8_all_gathered_weights_holds_plain_weights(job) -> None:
    saved, to_bf16 = job["moved/fp8_all_gather_saved"], job["moved/fp8_all_gather_to_bf16"]
    assert saved["float8_all_gather"] and not to_bf16["float8_all_gather"]
    assert largest_difference(saved["weights"], to_bf16["weights"]) == 0.0
    reverse = job["moved/bf16_to_fp8_all_gather"]
    assert reverse["float8_all_gather"]
    assert largest_difference(job["moved/bf16_saved"]["weights"], reverse["weights"]) == 0.0
