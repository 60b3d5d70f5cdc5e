"""2-process ZeRO training on CPU against one-process plain PyTorch, checkpoints, conversion, misuse.

`scripts/zero_train.py` runs every preset (and two bf16 runs) one after another in the same two
processes, which saves DeepSpeed's slow start-up; each test here checks one behaviour of one run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lite_deepspeed") is None or importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed here: these tests run in `hatch run test-deepspeed:all`",
    ),
    pytest.mark.multiprocess,
    pytest.mark.timeout(420),
]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "zero_train.py"
PRESETS = ["deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
           "deepspeed_stage_3", "deepspeed_stage_3_offload"]
BF16_RUNS = ["deepspeed_stage_2-bf16-true", "deepspeed_stage_3-bf16-mixed"]
LR, MAX_NORM, FEATURES = 0.05, 0.3, 4
#: bf16 keeps about 3 significant digits: its losses may differ from fp32 training by this much.
BF16_LOSS_TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    proc = run_script(command=[sys.executable, str(SCRIPT), str(out)], timeout=400)
    assert proc.returncode == 0, output_of(proc)
    results = torch.load(out / "results.pt", weights_only=False)
    results["out"], results["proc"] = out, proc
    return results


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.fixture(scope="module")
def plain(job):
    """The same training in one process: rank r's micro-batch i holds samples 4i+r and 4i+r+2,
    so the global micro-batch i is samples 4i..4i+3."""
    x, y = job["data"]
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, batches = [], iter(range(len(x) // 4))
    for step in range(6):
        accumulate = step >= 2
        for _ in range(2 if accumulate else 1):
            index = slice(4 * next(batches), None)
            loss = nn.functional.mse_loss(model(x[index][:4]), y[index][:4])
            loss.backward()
            losses.append(loss.item())
        if accumulate:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            at_save = {k: v.detach().clone() for k, v in model.named_parameters()}
    final = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "at_save": at_save, "final": final}


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("preset", PRESETS)
def test_fp32_training_equals_plain_pytorch(job, plain, preset):
    """Steps with one micro-batch, then accumulation under no_backward_sync plus clip_gradients."""
    run = job["runs"][preset]
    assert max(abs(a - b) for a, b in zip(run["losses"], plain["losses"], strict=True)) < 1e-5
    assert _max_difference(run["final"], plain["final"]) < 1e-5


@pytest.mark.parametrize("run_name", BF16_RUNS)
def test_bf16_trains_within_tolerance_of_fp32(job, plain, run_name):
    losses = job["runs"][run_name]["losses"]
    assert all(math.isfinite(v) for v in losses)
    assert max(abs(a - b) for a, b in zip(losses, plain["losses"], strict=True)) < BF16_LOSS_TOLERANCE


def test_fp16_trains_with_deepspeed_loss_scaling(job):
    # DeepSpeed's dynamic loss scale starts high and skips the steps that overflow, so the
    # losses are not compared with fp32 training; they must stay finite and resume exactly.
    if "deepspeed_stage_2-16-mixed" not in job["runs"]:
        pytest.skip("this CPU has no float16 that DeepSpeed accepts (AVX512-FP16 or AMX-FP16)")
    run = job["runs"]["deepspeed_stage_2-16-mixed"]
    assert all(math.isfinite(v) for v in run["losses"])
    assert run["resumed"]["losses"] == run["losses"][6:]


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_size_is_filled_in_from_the_dataloader(job, preset):
    micro, global_batch = job["runs"][preset]["batch_sizes"]
    assert (micro, global_batch) == (2, 4)  # batch_size=2 per rank, 2 ranks, no DeepSpeed accumulation


@pytest.mark.parametrize("preset", ["deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3-bf16-mixed"])
def test_zero3_model_built_in_run_outside_init_module_is_partitioned_by_setup(job, preset):
    run = job["runs"][preset]
    assert run["held_before_setup"] == [p.numel() for p in _model().parameters()]  # plain torch until setup
    for held, whole, shard in run["partition"]:
        assert held == 0, "the parameter was left whole on this rank by setup"
        assert shard == math.ceil(whole / 2)


@pytest.mark.parametrize("preset", PRESETS)
def test_initial_weights_equal_plain_pytorch_from_the_same_seed(job, preset):
    assert _max_difference(job["runs"][preset]["initial"], dict(_model().named_parameters())) == 0.0


def test_zero3_bf16_starts_from_plain_pytorch_weights_rounded_to_bf16(job):
    plain = {k: v.detach().to(torch.bfloat16).float() for k, v in _model().named_parameters()}
    assert _max_difference(job["runs"]["deepspeed_stage_3-bf16-mixed"]["initial"], plain) == 0.0


def test_rest_of_run_is_plain_torch_under_zero3_bf16(job):
    made = job["plain_torch"]["made"]
    assert made == {name: (torch.float32, "cpu") for name in ("tensor", "randn_cpu_generator", "zeros")}


def test_foreach_adamw_trains_under_zero3_bf16_with_in_place_output_edits(job):
    losses = job["plain_torch"]["losses"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and len(set(losses)) == 3


def test_config_activation_checkpointing_is_applied(job):
    assert job["plain_torch"]["activation_checkpointing"] == {
        "partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3,
        "synchronize": True, "profile": True}


def test_content_key_deepspeed_uses_itself_is_refused(job):
    message = job["misuse"]["reserved_key"]
    assert message.startswith("The key 'global_steps' in save()'s content is one DeepSpeed uses in its own"
                              " checkpoint: rename it") and "\n" not in message, message


@pytest.mark.parametrize("preset", ["deepspeed_stage_1", "deepspeed_stage_2"])
def test_lower_stages_keep_whole_parameters(job, preset):
    assert all(held == whole for held, whole, _ in job["runs"][preset]["partition"])


@pytest.mark.parametrize("preset", [*PRESETS, "deepspeed_stage_2-bf16-true"])
def test_checkpoint_resumes_to_the_same_losses(job, preset):
    run = job["runs"][preset]
    resumed = run["resumed"]
    assert resumed["step"] == 4 and resumed["note"] == preset  # the user's other state came back
    assert resumed["content_keys"] == ["note", "step"]
    assert resumed["losses"] == run["losses"][6:]  # a fresh model with other weights, resumed exactly


@pytest.fixture(scope="module")
def one_process_resumes(job, run_script, output_of):
    """The ZeRO-2 checkpoint of 2 processes resumed by 1 process under ZeRO-2 and ZeRO-3."""
    script = SCRIPT.with_name("resume_other_world.py")
    proc = run_script(command=[sys.executable, str(script), str(job["out"] / "ckpt_deepspeed_stage_2")], timeout=120)
    assert proc.returncode == 0, output_of(proc)
    *_, losses, environment = proc.stdout.strip().splitlines()
    return {**json.loads(losses), "environment": json.loads(environment)}


@pytest.mark.parametrize("stage", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_checkpoint_resumes_with_another_number_of_processes_and_stage(job, one_process_resumes, stage):
    expected = job["runs"]["deepspeed_stage_2"]["losses"][6:]
    assert max(abs(a - b) for a, b in zip(one_process_resumes[stage], expected, strict=True)) < 1e-5


def test_launcher_variables_deepspeed_reads_are_removed_again_at_teardown(one_process_resumes):
    # The script starts without them (a plain one-process run); DeepSpeed reads them all run long.
    environment = one_process_resumes["environment"]
    assert environment["during"] == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert environment["after_teardown"] == {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}


def test_zero3_bf16_checkpoint_resumes_on_cpu_to_the_same_losses(job):
    run = job["runs"]["deepspeed_stage_3-bf16-mixed"]  # DeepSpeed's own load corrupts it: read whole
    assert isinstance(run["resumed"], dict), run["resumed"]
    assert max(abs(a - b) for a, b in zip(run["resumed"]["losses"], run["losses"][6:], strict=True)) < 1e-2


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_converts_to_a_plain_state_dict(job, plain, preset, tmp_path):
    from lite_deepspeed import convert_to_fp32_state_dict

    convert_to_fp32_state_dict(job["out"] / f"ckpt_{preset}", tmp_path / "full.pt")
    model = _model()
    model.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True))
    assert _max_difference(dict(model.named_parameters()), plain["at_save"]) < 1e-5


def test_convert_command_line(job, tmp_path):
    command = Path(sys.executable).with_name("lite-deepspeed-convert")
    out = subprocess.run([str(command), str(job["out"] / "ckpt_deepspeed_stage_3"), str(tmp_path / "full.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    assert sorted(state) == sorted(_model().state_dict())
    missing = subprocess.run([str(command), str(tmp_path / "nothing"), str(tmp_path / "x.pt")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "is not a DeepSpeed checkpoint directory" in missing.stderr


@pytest.mark.parametrize(("case", "expected"), [
    ("direct_backward", "loss.backward() was called on a DeepSpeed model's output: call lite.backward(loss)"),
    ("no_model", "2 models are set up and strategy='deepspeed_stage_2' runs backward through the model"),
    ("clip_val", "DeepSpeed clips gradients by norm only"),
    ("two_optimizers", "DeepSpeed steps one optimizer per model"),
    # its state lives in the engine's partitions: a one-file save held rank 0's partition alone
    ("optimizer_alone", "save()'s content holds the DeepSpeed optimizer 'optimizer' without its model"),
])
def test_misuse_is_one_sentence_error(job, case, expected):
    message = job["misuse"][case]
    assert message.startswith(expected) and "\n" not in message, message


def test_in_place_edit_of_a_model_output_works_as_in_plain_pytorch(job):
    assert job["misuse"]["in_place_on_output"] == "no error"


def test_a_path_saved_under_another_strategy_takes_deepspeeds_folder_and_back(job):
    """A one-file checkpoint at the path is replaced by DeepSpeed's folder (written beside it and
    put in place: it failed with FileExistsError), and the folder by a file again, with rank 1
    still reading the folder (the file replaced it under rank 1 and it read step 3, or failed
    without DeepSpeed's `latest` file); nothing is left beside."""
    every_rank, leftovers = job["misuse"]["layout_switch"]
    assert every_rank == [[(False, 1), (True, 2), (False, 3)]] * 2
    assert leftovers == []


def test_setup_optimizers_alone_is_refused(job):
    assert job["misuse"]["optimizers_alone"].startswith("DeepSpeed sets up a model and its optimizer together")


def test_setup_module_alone_needs_stage_3(job):
    assert job["misuse"]["module_alone"].startswith("ZeRO stage 2 shards the optimizer, so it needs one")
    assert job["nested_init"]["inference_shape"] == (2, 1)  # stage 3: an engine for inference


def test_lr_scheduler_drives_the_optimizer_deepspeed_steps(job):
    assert job["misuse"]["lr_after_schedule"] == pytest.approx(0.05)  # 0.1 halved once


def test_zero3_init_module_inside_run_partitions(job):
    partition = job["nested_init"]["partition"]
    assert partition and all(held == 0 for held, _, _ in partition)


def test_teardown_destroys_the_process_group(job):
    for rank in (0, 1):
        assert (job["out"] / f"teardown_rank{rank}.txt").read_text() == "destroyed"
    assert "Traceback" not in job["proc"].stderr
