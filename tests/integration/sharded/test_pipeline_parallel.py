"""Pipeline parallelism (`ModelParallelStrategy(pipeline_parallel_size=2)`) on real processes over
gloo, compared with one plain PyTorch process over the same global batches: PP2 under GPipe, 1F1B
and interleaved 1F1B, PP2 x DP2 (FSDP2), PP2 x TP2, PP2 x DP2 x TP2; the same user loop under
`ddp`, `fsdp` and 2-D `model_parallel`; checkpoints that move between PP2 x DP2, `ddp`, PP2 and one
process; and the bad inputs. One job per world size (`tests/scripts/pipeline_job.py`) runs every
layout of that size in one start of its processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lite_core import LightningLite
from lite_core.checkpoint import consolidate

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pipeline_job.py"
_spec = importlib.util.spec_from_file_location("pipeline_job", _SCRIPT)
job_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_module)  # the job's model, data, loss and loop

ATOL = 1e-6


def _run(run_script, output_of, out_dir: Path, world: int, *extra: object, timeout: float = 240,
         store_timeout: int = 60) -> dict:
    # Several processes on a small machine import torch slowly: the store waits longer than usual.
    proc = run_script(_SCRIPT, out_dir, world, *extra, timeout=timeout,
                      env={"LITE_COLLECTIVE_TIMEOUT": str(store_timeout)})
    assert proc.returncode == 0, output_of(proc)
    return {**torch.load(out_dir / "results.pt", weights_only=True), "out_dir": out_dir}


@pytest.fixture(scope="module")
def job4(run_script, output_of, tmp_path_factory):
    return _run(run_script, output_of, tmp_path_factory.mktemp("pipeline-4"), 4)


@pytest.fixture(scope="module")
def job2(run_script, output_of, tmp_path_factory, job4):
    # Runs after job4: it resumes job4's PP2 x DP2 checkpoint under ddp, and that one under PP2.
    return _run(run_script, output_of, tmp_path_factory.mktemp("pipeline-2"), 2,
                job4["out_dir"] / "pp2xdp2_sharded")


@pytest.fixture(scope="module")
def job8(run_script, output_of, tmp_path_factory):
    return _run(run_script, output_of, tmp_path_factory.mktemp("pipeline-8"), 8, timeout=280, store_timeout=120)


def plain_pytorch(initial: dict, kind: str, steps: int, clip: bool) -> dict:
    """One process: the same model, SGD with momentum and StepLR, over the same global batches."""
    model = job_module.make_model(kind)
    model.load_state_dict(initial)
    optimizer, scheduler = job_module.make_optimizer(model)
    x, y = job_module.make_data()
    batch = job_module.GLOBAL_BATCH
    losses, norms, weights = [], [], []
    for step in range(steps):
        optimizer.zero_grad()
        loss = job_module.loss_fn(model(x[step * batch:(step + 1) * batch]), y[step * batch:(step + 1) * batch])
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job_module.MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        first = x[:batch]
        return {"losses": losses, "norms": norms, "weights": weights, "model": model,
                "eval": lambda rows: (job_module.loss_fn(model(first[:rows]), y[:rows]), model(first[:rows]))}


def assert_weights(actual: dict, expected: dict, initial: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=ATOL, rtol=0, msg=name)
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 100 * ATOL, "training barely changed the weights; the comparison would prove nothing"


def assert_matches_one_process(run: dict, kind: str = "net", clip: bool = True) -> None:
    plain = plain_pytorch(run["initial"], kind, job_module.STEPS, clip)
    assert_weights(run["final"], plain["weights"][-1], run["initial"])
    # Every rank holds the loss of its data-parallel shard (as under ddp); their mean is the one
    # process's loss over the global batch.
    for step, seen in enumerate(run["losses"]):
        torch.testing.assert_close(seen.mean(), torch.tensor(plain["losses"][step]), atol=ATOL, rtol=0)
    if clip:  # one norm over every stage's gradients
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(plain["norms"]), atol=ATOL, rtol=0)
        assert min(plain["norms"]) > job_module.MAX_NORM, "clipping did not happen; the test would prove nothing"
    rows = run["eval_output"].shape[1]  # evaluation under no_grad: forward only, on every rank
    loss, output = plain["eval"](rows)
    torch.testing.assert_close(run["eval_loss"], loss.expand(run["eval_loss"].shape), atol=ATOL, rtol=0)
    for rank_output in run["eval_output"]:
        torch.testing.assert_close(rank_output, output, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["pp2_GPipe", "pp2_1F1B", "pp2_Interleaved1F1B"])
def test_pipeline_schedules_match_one_plain_process(job2, layout):
    assert_matches_one_process(job2[layout])


def test_an_nn_sequential_is_split_evenly_without_split_points(job2):
    run = job2["pp2_sequential"]
    assert_matches_one_process(run, kind="sequential", clip=False)
    assert run["local_keys"] == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]


def test_a_transformer_is_cut_inside_its_blocks_without_split_points(job2):
    # embed, blocks (4), norm, head: the blocks are cut evenly; before, every block went to stage 0
    # and stage 1's `for block in self.blocks` failed on None.
    run = job2["pp2_transformer"]
    assert_matches_one_process(run, kind="transformer")
    assert run["local_keys"] == sorted(k for k in job_module.make_model("transformer").state_dict()
                                       if k.startswith(("embed.", "blocks.0.", "blocks.1.")))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "model_parallel_2d"])
def test_the_same_loop_runs_without_a_pipeline(job2, strategy):
    assert_matches_one_process(job2[strategy])


def test_the_same_loop_runs_on_one_process():
    lite = LightningLite(accelerator="cpu", devices=1)
    model = job_module.make_model("net")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = job_module.make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=job_module.loss_fn)
    for step in range(job_module.STEPS):
        job_module.training_step(lite, model, optimizer, scheduler, step, clip=True)
    expected = plain_pytorch(initial, "net", job_module.STEPS, clip=True)["weights"][-1]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("layout", ["pp2xdp2_1F1B", "pp2xdp2_Interleaved1F1B", "pp2xtp2_GPipe"])
def test_pipeline_with_fsdp2_or_tensor_parallel_matches_one_plain_process(job4, layout):
    run = job4[layout]
    assert_matches_one_process(run)
    # Each process holds its stages' layers, under the unsplit model's names.
    assert "head.weight" not in run["local_keys"] and "blocks.0.up.weight" in run["local_keys"]


@pytest.mark.parametrize("layout", ["pp2xdp2_transformer", "pp2xtp2_transformer"])
def test_a_transformer_under_a_pipeline_with_fsdp2_or_tensor_parallel_matches_one_plain_process(job4, layout):
    assert_matches_one_process(job4[layout], kind="transformer")


def test_pipeline_with_fsdp2_and_tensor_parallel_on_8_processes(job8):
    assert_matches_one_process(job8["pp2xdp2xtp2_1F1B"])


def test_checkpoints_move_between_pipeline_ddp_and_one_process(job2, job4, tmp_path):
    saved = job4["checkpoint"]
    initial = job4["pp2xdp2_1F1B"]["initial"]
    plain = plain_pytorch(initial, "net", job_module.STEPS + 2, clip=True)
    assert_weights(saved["saved"], plain["weights"][job_module.STEPS - 1], initial)
    assert_weights(saved["one_more"], plain["weights"][job_module.STEPS], initial)
    # lite.full_state_dict gathers every stage to rank 0, in the whole model's order.
    assert list(saved["full_state_dict"]) == list(job_module.make_model("net").state_dict())
    assert_weights(saved["full_state_dict"], plain["weights"][job_module.STEPS - 1], initial)
    again = job4["from_pp2xdp2_on_pp2xdp2"]  # its own shards, resumed under the same layout
    assert again["loaded_step"] == job_module.STEPS
    assert_weights(again["final"], plain["weights"][job_module.STEPS], initial)
    assert again["lr"] == pytest.approx([job_module.LR * 0.5 ** (job_module.STEPS + 1)])
    on_ddp = job2["from_pp2xdp2_on_ddp"]  # PP2 x DP2's shards, resumed under ddp on 2 processes
    assert on_ddp["loaded_step"] == job_module.STEPS
    assert_weights(on_ddp["final"], plain["weights"][job_module.STEPS], initial)
    on_pp2 = job2["from_ddp_on_pp2"]  # ddp's one file (a numbered optimizer state), resumed under PP2
    assert on_pp2["loaded_step"] == job_module.STEPS + 1
    assert_weights(on_pp2["final"], plain["weights"][job_module.STEPS + 1], initial)
    assert on_pp2["lr"] == pytest.approx([job_module.LR * 0.5 ** (job_module.STEPS + 2)])
    # PP2's shards on one process, and as one torch.load-able file.
    lite = LightningLite(accelerator="cpu", devices=1)
    state = job_module.set_up(lite)
    lite.load(job2["out_dir"] / "pp2_sharded", state)
    assert state["step"] == job_module.STEPS + 2
    assert_weights({k: v for k, v in state["model"].state_dict().items()}, plain["weights"][-1], initial)
    consolidate(job2["out_dir"] / "pp2_sharded", tmp_path / "one.pt")
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    assert_weights(whole["model"], plain["weights"][-1], initial)


def test_batches_of_8_then_4_then_2_train_and_evaluate_as_one_plain_process(job2):
    # microbatches=2: each size gets a schedule of its own shapes (stale ones crashed training and
    # returned 8 rows of wrong values for a batch of 4 under no_grad); then a batch of 8 again.
    run = job2["shrinking_batches"]
    model = job_module.make_model("net")
    model.load_state_dict(run["initial"])
    optimizer, scheduler = job_module.make_optimizer(model)
    x, y = job_module.make_data()
    start = 0
    for index, size in enumerate((*job_module.SIZES, None)):
        if size is None:
            xb, yb = x[:job_module.SIZES[0]], y[:job_module.SIZES[0]]
        else:
            xb, yb = x[start:start + size], y[start:start + size]
            start += size
            optimizer.zero_grad()
            loss = job_module.loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            scheduler.step()
            torch.testing.assert_close(run["losses"][index], loss.detach().expand(2), atol=1e-6, rtol=0)
        with torch.no_grad():
            expected = model(xb)
        assert run["outputs"][index].shape == (2, *expected.shape)  # every rank: the batch's rows, no more
        for rank_output in run["outputs"][index]:
            torch.testing.assert_close(rank_output, expected, atol=1e-6, rtol=0)
        loss = job_module.loss_fn(expected, yb)
        torch.testing.assert_close(run["eval_losses"][index], loss.expand(2), atol=1e-6, rtol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(run["final"][name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("layout", ["epochs_pp2", "epochs_ddp"])
def test_an_evaluation_each_epoch_changes_nothing_in_training(job2, layout):
    # Three epochs of batches of 8, 8, 4 (microbatches=2) with and without an evaluation of a batch
    # of 4 between them, of a model with BatchNorm (running statistics: training state that a
    # forward pass in training mode changes); ddp is the control.
    _evaluation_changed_nothing(job2[layout], layout)


@pytest.mark.parametrize("layout", ["epochs_pp2xdp2", "epochs_pp2xtp2"])
def test_an_evaluation_each_epoch_changes_nothing_under_a_pipeline_with_data_or_tensor_parallel(job4, layout):
    # As above on 4 processes: FSDP2 over the data-parallel ranks (each its half of every batch),
    # or tensor parallel inside the blocks; every rank gathers its replica's whole output.
    _evaluation_changed_nothing(job4[layout], layout)


def _evaluation_changed_nothing(run: dict, layout: str) -> None:
    with_evaluation, without = run["with"], run["without"]
    assert with_evaluation["final"].keys() == without["final"].keys()
    assert any("running_mean" in name for name in without["final"])
    for name, value in without["final"].items():
        assert torch.equal(with_evaluation["final"][name], value), name  # bitwise
    for seen in with_evaluation["evaluations"]:
        assert seen["unchanged"]  # the last step's gradients, the random state
        output = seen["output"].reshape(-1, job_module.WIDTH)  # every rank's
        target = seen["target"].reshape(-1, job_module.WIDTH)
        if layout == "epochs_pp2":  # every stage holds the whole output and loss
            output, target = output[:job_module.VALIDATION], target[:job_module.VALIDATION]
            torch.testing.assert_close(seen["output"][1], seen["output"][0], atol=0, rtol=0)
        loss = job_module.loss_fn(output, target)
        torch.testing.assert_close(seen["loss"].mean(), loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(seen["eval_mode_loss"].mean(), loss, atol=1e-6, rtol=0)


def test_bad_input_is_refused_in_one_sentence(job2):
    errors = job2["errors"]
    assert "'blocks.9' names no module" in errors["no_module"]
    assert "8 pipeline stages need at least as many layers" in errors["too_many"]
    assert "does not split into microbatches=3" in errors["uneven"]
    assert "needs the target" in errors["no_target"]
    assert "backward() takes the loss that model(x, target=y) returned since the last" in errors["other_tensor"]
    assert errors["eval_mode_grads"] == 0 and errors["eval_mode_loss"] > 0  # model.eval(): forward only


def plain_bfloat16_step(model, xb, yb, microbatches: int, mixed: bool) -> torch.Tensor:
    """One plain process's step in bfloat16 as the schedule computes it: a loss and a backward per
    micro-batch (the gradients add up in the parameters' dtype), the sum divided by their number,
    and the micro-batches' mean loss reported."""
    losses = []
    for xm, ym in zip(xb.chunk(microbatches), yb.chunk(microbatches)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = job_module.loss_fn(model(xm if mixed else xm.to(torch.bfloat16)),
                                      ym if mixed else ym.to(torch.bfloat16))
        loss.backward()
        losses.append(loss.detach().float())
    for parameter in model.parameters():
        parameter.grad.div_(microbatches)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bfloat16_precisions_equal_plain_bfloat16_with_the_same_micro_batches(job2, precision):
    # Like with like: plain bfloat16 over the same micro-batches, not fp32 and not one whole batch
    # (which rounds differently by about 1e-2).
    run = job2[f"pp2_{precision}"]
    model = job_module.make_model("net")
    model.load_state_dict(run["initial"])
    mixed = precision == "bf16-mixed"
    model = model if mixed else model.to(torch.bfloat16)
    optimizer, scheduler = job_module.make_optimizer(model)
    x, y = job_module.make_data()
    batch = job_module.GLOBAL_BATCH
    for step, seen in enumerate(run["losses"]):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        optimizer.zero_grad()
        loss = plain_bfloat16_step(model, xb, yb, job_module.MICROBATCHES, mixed)
        optimizer.step()
        scheduler.step()
        assert len(set(seen.tolist())) == 1  # the same loss on both stages
        torch.testing.assert_close(seen[0], loss, atol=0, rtol=0)
    assert run["final"].keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(run["final"][name], value.float(), atol=0, rtol=0, msg=name)
    moved = max((value.float() - run["initial"][name]).abs().max().item() for name, value in model.state_dict().items())
    assert moved > 1e-2


def test_every_stage_of_a_pipeline_gets_its_data_parallel_ranks_batches(job4):
    batches = job4["first_batches"]  # ranks 0, 1: stage 0 of data-parallel ranks 0, 1; ranks 2, 3: stage 1
    torch.testing.assert_close(batches[0], batches[2], atol=0, rtol=0)
    torch.testing.assert_close(batches[1], batches[3], atol=0, rtol=0)
    assert not torch.equal(batches[0], batches[1])
