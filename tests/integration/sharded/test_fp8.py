"""FP8 through torchao (emulated) under ddp, fsdp and model_parallel (tensor parallel; a 2-stage
pipeline) on 2 processes over gloo, each against the same parallel loop written by hand with
torchao's conversion applied by hand (the pipeline against one plain process)
(`tests/scripts/fp8_job.py`, one start of the processes for every case). FP8 is compared with
FP8, never with float32."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="needs lite-core[fp8] (torchao), which the test environment installs")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]  # hang guard: the job takes ~40 s idle

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fp8_job.py"
RECIPES = ("tensorwise", "rowwise")


@pytest.fixture(scope="module")
def job_folder(run_script, output_of, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8")
    proc = run_script(_SCRIPT, out, timeout=480, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return out


@pytest.fixture(scope="module")
def job(job_folder):
    return torch.load(job_folder / "results.pt", weights_only=True)


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


def test_a_sharded_fp8_checkpoint_reads_in_a_process_without_torchao(job, job_folder, tmp_path) -> None:
    """torchao's float8 all-gather wraps each weight shard in its own tensor class: the sharded files
    hold the plain shards, which `consolidate` reads where torchao cannot even be imported, and
    which load back into the same FP8 run."""
    reader = (
        "import sys; sys.modules['torchao'] = None\n"  # `import torchao` fails here
        "from lite_core.checkpoint import consolidate\n"
        "consolidate(sys.argv[1], sys.argv[2])\n"
    )
    fresh = {**os.environ, "LITE_TEST_FORKSERVER": "0"}  # not forked from the session's server, which imported torchao
    proc = subprocess.run([sys.executable, "-c", reader, str(job_folder / "fp8_all_gather_sharded"),
                           str(tmp_path / "one.pt")], capture_output=True, text=True, timeout=120, env=fresh)
    assert proc.returncode == 0, proc.stderr
    weights = torch.load(tmp_path / "one.pt", weights_only=True)["model"]
    assert all(type(tensor) is torch.Tensor for tensor in weights.values())
    saved = job["moved/fp8_all_gather_saved"]["weights"]
    assert largest_difference(saved, weights) == 0.0
    round_trip = job["moved/fp8_all_gather_round_trip"]
    assert round_trip["float8_all_gather"] and largest_difference(saved, round_trip["weights"]) == 0.0
