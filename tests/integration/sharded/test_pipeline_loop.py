"""The user's own loop under pipeline parallelism (issue 57) on real processes over gloo, against one
plain PyTorch process: accumulation over batches with `no_backward_sync` and `backward(loss / n)`,
a forward without guards for the layers a stage does not hold, and the FLOPs the monitor counts
(`tests/scripts/pipeline_loop_job.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
_SCRIPT = _SCRIPTS / "pipeline_loop_job.py"
sys.path.insert(0, str(_SCRIPTS))
_spec = importlib.util.spec_from_file_location("pipeline_loop_job", _SCRIPT)
loop_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_job)
job = loop_job.job  # pipeline_job: the model, data, optimizer and loss

ATOL = 1e-6


def _run(run_script, output_of, out_dir: Path, world: int) -> dict:
    # Several processes on a small machine import torch slowly: the store waits longer than usual.
    proc = run_script(_SCRIPT, out_dir, world, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out_dir / "results.pt", weights_only=True)


@pytest.fixture(scope="module")
def job2(run_script, output_of, tmp_path_factory):
    return _run(run_script, output_of, tmp_path_factory.mktemp("pipeline-loop-2"), 2)


@pytest.fixture(scope="module")
def job4(run_script, output_of, tmp_path_factory):
    return _run(run_script, output_of, tmp_path_factory.mktemp("pipeline-loop-4"), 4)


def plain_accumulation(initial: dict) -> tuple[list[float], list[float], dict]:
    """One process, the same loop: `backward(loss / n)` over `ACCUMULATE` batches per step."""
    model = job.make_model("net")
    model.load_state_dict(initial)
    optimizer, scheduler = job.make_optimizer(model)
    x, y = job.make_data()
    batch, losses, norms = job.GLOBAL_BATCH, [], []
    for step in range(loop_job.OPTIMIZER_STEPS):
        for index in range(loop_job.ACCUMULATE):
            start = (step * loop_job.ACCUMULATE + index) * batch
            loss = job.loss_fn(model(x[start:start + batch]), y[start:start + batch])
            (loss / loop_job.ACCUMULATE).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job.MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses, norms, model.state_dict()


def assert_accumulates_as_one_process(run: dict) -> None:
    losses, norms, expected = plain_accumulation(run["initial"])
    for seen, loss in zip(run["losses"], losses):  # every rank holds its data-parallel shard's loss
        torch.testing.assert_close(seen.mean(), torch.tensor(loss), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms), atol=ATOL, rtol=0)
    assert min(norms) > job.MAX_NORM  # clipping happened: the norms are those of the accumulated gradients
    assert run["final"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(run["final"][name], value, atol=ATOL, rtol=0, msg=name)
    moved = max((value - run["initial"][name]).abs().max().item() for name, value in expected.items())
    assert moved > 1000 * ATOL


def test_accumulation_with_a_scaled_loss_equals_one_plain_process(job2):
    assert_accumulates_as_one_process(job2["accumulation_pp2"])


def test_accumulation_under_pipeline_and_data_parallel_equals_one_plain_process(job4):
    assert_accumulates_as_one_process(job4["accumulation_pp2xdp2"])


def test_accumulation_under_pipeline_and_tensor_parallel_equals_one_plain_process(job4):
    assert_accumulates_as_one_process(job4["accumulation_pp2xtp2"])


def test_a_loss_scale_that_differs_between_data_parallel_ranks_is_refused_on_each(job4):
    for message in job4["scale_per_replica"]:
        assert "factors that differ between data-parallel ranks (1.0 to 2.0)" in message


def test_a_gpt_whose_forward_has_no_guards_trains_and_evaluates_as_one_plain_process(job2):
    # Stage 1 calls self.embed on the activations it receives and stage 0 self.norm and self.head on
    # its blocks' output: those layers hand their input on (they raised TypeError on None before).
    run = job2["unguarded_pp2"]
    model = loop_job.make_gpt()
    model.load_state_dict(run["initial"])
    optimizer, scheduler = job.make_optimizer(model)
    tokens, targets = loop_job.gpt_data()
    batch = job.GLOBAL_BATCH
    for step, seen in enumerate(run["losses"]):
        optimizer.zero_grad()
        loss = loop_job.gpt_loss(model(tokens[step * batch:(step + 1) * batch]), targets[step * batch:(step + 1) * batch])
        loss.backward()
        optimizer.step()
        scheduler.step()
        torch.testing.assert_close(seen, loss.detach(), atol=ATOL, rtol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(run["final"][name], value, atol=ATOL, rtol=0, msg=name)
    with torch.no_grad():
        logits = model(tokens[2 * batch:3 * batch])
    torch.testing.assert_close(run["eval_output"], logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(run["eval_loss"], loop_job.gpt_loss(logits, targets[2 * batch:3 * batch]), atol=ATOL, rtol=0)


def test_a_forward_that_breaks_the_contract_is_refused_on_every_stage_before_the_schedule(job2):
    # Only stage 1 breaks it (embed(tokens) * 2 where it does not hold embed); stage 0 would wait
    # for its gradients until the job's 60 s collective timeout and fail the job.
    expected = ("MisuseError: Pipeline stage 1 does not hold 'embed', and your forward changes its output before"
                " 'blocks.2'")
    assert [message[:len(expected)] for message in job2["contract"]] == [expected, expected], job2["contract"]


def test_measure_flops_counts_the_whole_model_before_and_after_setup_and_the_monitor_once(job2):
    from lite_core import measure_flops

    whole = measure_flops(loop_job.make_gpt(), loop_job.gpt_data()[0][:job.GLOBAL_BATCH])
    counts = job2["flops"]["counts"]  # per rank: before setup, after (on meta, on the device), the monitor's
    assert counts.shape == (2, 4)
    # After setup stage 0 counted only its layers, and stage 1 raised on the token ids.
    assert (counts == whole).all(), counts
    assert job2["flops"]["devices"] == 2  # MFU divides the job's FLOPs (one replica's, once) by both
