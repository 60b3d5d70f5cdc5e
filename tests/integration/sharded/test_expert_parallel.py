"""Expert parallelism (`lite_core.parallel.ExpertParallel`) on 2 real processes over gloo
(`tests/scripts/expert_parallel_job.py`): a tiny hand-written MoE with its experts sharded over the
data-parallel dimension (EP 2), each process on its own half of the global batch, ends where one
plain PyTorch process ends on the whole batch (AdamW, fp32, 1e-6); so does the same job with the
experts on the `"expert_parallel"` dimension of `MeshLayout(shard=2, expert=2)`, and a tiny Hugging
Face MoE of each family in `HF_FAMILIES` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3,
gpt-oss) whose
experts module (transformers' own) is called as transformers calls it; each one's checkpoint loads
whole on one process and its export in transformers' `from_pretrained`.

On 4 processes (`tests/scripts/expert_parallel_4_job.py`, one launch): EP 2 x data 2, EP 4 and EP 2 x
tensor 2, trained with gradient accumulation and clipping, end where one plain process ends (SGD with
momentum, fp32, 1e-6), and so does EP 2 under a 2-stage pipeline; a checkpoint saved under EP 4
loads under EP 2 and on one plain process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "expert_parallel_job.py"
_spec = importlib.util.spec_from_file_location("expert_parallel_job", _SCRIPT)
job_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_module)


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("expert-parallel")
    # Several processes on a small machine import torch slowly: the store waits longer than usual.
    proc = run_script(_SCRIPT, out_dir, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out_dir / "results.pt", weights_only=True)


_WAYS = ["data_parallel", "expert_parallel", "balanced"]
#: The weight of the router's load-balancing loss in each way's loss (`balanced`: global, computed
#: over both processes' tokens by `lite_core.parallel.load_balancing_loss`).
_BALANCE = {"data_parallel": 0.0, "expert_parallel": 0.0, "balanced": job_module.BALANCE}


@pytest.mark.parametrize("way", _WAYS)
def test_ep2_trains_to_the_weights_of_one_plain_process(job, way, assert_weights_match):
    run = job[way]
    expected = job_module.plain_pytorch(run["initial"], _BALANCE[way])
    assert_weights_match(run["final"], expected["final"], run["initial"])
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)


@pytest.mark.parametrize("way", _WAYS)
def test_ep2_gradients_are_those_of_one_plain_process(job, way):
    run = job[way]
    # Expert gradients are summed over the tokens of both processes and non-expert ones averaged:
    # both must come out as one process's gradient over the whole batch (AdamW would hide a factor).
    # With the load-balancing loss, so must the router's share of it.
    expected = job_module.plain_pytorch(run["initial"], _BALANCE[way])["gradients"]
    assert run["gradients"].keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(run["gradients"][name], gradient, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("way", _WAYS)
def test_expert_load_counts_each_experts_tokens_over_every_process_as_one_process_sees_them(job, way):
    run = job[way]
    expected = job_module.plain_pytorch(run["initial"], _BALANCE[way])["loads"]
    assert run["loads"].shape == (job_module.STEPS, job_module.EXPERTS)
    assert torch.equal(run["loads"], expected), (run["loads"], expected)
    assert int(run["loads"][0].sum()) == job_module.GLOBAL_BATCH * job_module.TOP_K


def test_the_load_balancing_loss_moves_the_router_and_one_process_computes_transformers_value(job):
    # Under EP 2 the balanced run must differ from the unbalanced one, or matching one process
    # would prove nothing about the loss; on one process it is transformers' own loss.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from lite_core.parallel import load_balancing_loss

    moved = (job["balanced"]["final"]["router.weight"] - job["expert_parallel"]["final"]["router.weight"]).abs().max()
    assert moved > 1e-3, moved
    logits = tuple(torch.randn(10, job_module.EXPERTS, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    probs = torch.softmax(torch.cat(logits), dim=-1)
    torch.testing.assert_close(load_balancing_loss(probs, probs.topk(job_module.TOP_K, dim=-1).indices),
                               load_balancing_loss_func(logits, job_module.EXPERTS, job_module.TOP_K), atol=0, rtol=0)


def test_an_expert_layout_hands_parallelize_fn_a_named_expert_dimension(job):
    assert job["data_parallel"]["dim_names"] == ["data_parallel", "tensor_parallel"]
    assert job["expert_parallel"]["dim_names"] == ["expert_data_parallel", "expert_parallel", "tensor_parallel"]


def test_every_process_routed_tokens_to_the_other_processes_experts(job):
    # Otherwise EP 2 would never have sent a token anywhere and the comparison would prove little.
    model = job_module.make_model()
    model.load_state_dict(job["data_parallel"]["initial"])
    x, _ = job_module.make_data()
    half = job_module.GLOBAL_BATCH // job_module.WORLD
    with torch.no_grad():
        chosen = model.router(model.embed(x[:job_module.GLOBAL_BATCH])).topk(job_module.TOP_K, dim=-1).indices
    local = job_module.EXPERTS // job_module.WORLD
    for rank in range(job_module.WORLD):
        owners = set((chosen[rank * half:(rank + 1) * half] // local).flatten().tolist())
        assert owners == {0, 1}, rank


@pytest.mark.parametrize(("case", "message"), [
    ("uneven", "The mesh dimension of size 2 does not divide the 3 experts of _ThreeExperts: shard them over a"
               " dimension whose size divides the number of experts."),
    ("not_stacked", "ExpertParallel needs a module whose own parameters are stacked experts [num_experts, ...] of"
                    " one num_experts, but Linear holds weight [8, 8], bias [8]: apply it to the module that holds"
                    " the stacked expert weights."),
    ("two_dims", "ExpertParallel got a 2-D mesh: pass the one dimension the experts are sharded over, e.g."
                 " parallelize_module(experts, device_mesh['data_parallel'], ExpertParallel())."),
    ("call", "Experts under ExpertParallel got 1 positional argument(s), not the two tensors of"
             " experts(tokens, num_tokens_per_expert) nor the three of Hugging Face's experts(hidden_states,"
             " top_k_index, top_k_weights): pass the tokens sorted by expert and their count per expert."),
    ("load_of_plain", "expert_load() takes an experts module under ExpertParallel, but Experts is not one: pass the"
                      " module you applied parallelize_module(..., ExpertParallel()) to."),
    ("ddp", "strategy='ddp' cannot hold the experts of 'experts' under ExpertParallel, since each process keeps other"
            " experts and their gradients would be averaged together: use ModelParallelStrategy(parallelize_fn,"
            " mesh=MeshLayout(expert=...)) and apply ExpertParallel inside parallelize_fn."),
])
def test_what_expert_parallel_cannot_shard_or_call_is_refused_in_one_sentence(job, case, message):
    assert job["refusals"][case] == message


def test_experts_computed_by_grouped_mm_give_under_ep2_what_they_give_whole(job):
    # bfloat16 (torch._grouped_mm on CPU): the same products on the same rows, wherever they run.
    result = job["grouped"]
    assert result["whole"].shape[0] > 0
    torch.testing.assert_close(result["sharded"], result["whole"])
    torch.testing.assert_close(result["sharded_grad"], result["whole_grad"])


def test_experts_wrapped_for_fp8_stay_wrapped_under_ep2_and_reach_torchaos_kernel(job):
    # Float8Precision(experts="rowwise") converts before parallelize_fn: the shards ExpertParallel
    # makes of torchao's wrappers must stay wrappers, or the products would silently run in bf16.
    result = job["grouped_fp8"]
    assert result["local_type"] == "Float8TrainingWeightWrapperTensor"
    assert result["whole_kernel_calls"] == result["sharded_kernel_calls"] == ["Tensor", "Tensor"]
    torch.testing.assert_close(result["sharded"], result["whole"], rtol=0, atol=0)
    torch.testing.assert_close(result["sharded_grad"], result["whole_grad"], rtol=0, atol=0)


_FAMILIES = list(job_module.HF_FAMILIES)


@pytest.mark.parametrize("family", _FAMILIES)
def test_a_hugging_face_moe_under_ep2_trains_as_one_plain_process(job, family, assert_weights_match):
    # transformers' experts modules (Qwen3MoeExperts, MixtralExperts, ...) are called
    # experts(hidden_states, top_k_index, top_k_weights) and loop over their stacked experts
    # themselves: ExpertParallel takes that call as it is, whatever router feeds it.
    run = job[family]
    assert run["local_experts"] == job_module.EXPERTS // job_module.WORLD  # each process holds half the experts
    expected = job_module.plain_hf_moe(run["initial"], family)
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    assert_weights_match(run["final"], expected["final"], run["initial"])


@pytest.mark.parametrize("family", _FAMILIES)
def test_an_ep2_checkpoint_loads_whole_on_one_process_and_its_export_in_transformers(job, family):
    # The experts were DTensors sharded over the processes; the checkpoint holds them whole under
    # the model's own keys, and the export in Hugging Face's layout (stacked experts) loads in
    # transformers' own from_pretrained.
    from lite_core import LightningLite

    run = job[family]
    lite = LightningLite(accelerator="cpu", devices=1)
    model = lite.setup(job_module.make_hf_moe(family))
    lite.load(run["checkpoint"], {"model": model})
    loaded = model.state_dict()
    assert loaded.keys() == run["final"].keys()
    for name, value in run["final"].items():
        assert torch.equal(loaded[name], value), name
    exported = job_module.hf_model_class(family).from_pretrained(run["export"])
    tokens = job_module.qwen_tokens()[:2]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, model(input_ids=tokens).logits, atol=0, rtol=0)


# -- 4 processes -----------------------------------------------------------------------------------
# One launch of `tests/scripts/expert_parallel_4_job.py` runs every 4-process layout in sequence:
# EP 2 x data 2, EP 4 and EP 2 x tensor 2, each trained with gradient accumulation and clipping, then
# the EP 4 checkpoint loaded under EP 2 x data 2.

_SCRIPT_4 = _SCRIPT.with_name("expert_parallel_4_job.py")
_spec_4 = importlib.util.spec_from_file_location("expert_parallel_4_job", _SCRIPT_4)
job4_module = importlib.util.module_from_spec(_spec_4)
_spec_4.loader.exec_module(job4_module)

_LAYOUTS_4 = ["ep2_dp2", "ep4", "ep2_tp2"]
#: The layouts' runs and `ep2_dp2` with the router's load-balancing loss (over the 4 data-parallel
#: processes' micro-batch, where the experts' own group has 2).
_TRAINED_4 = [*_LAYOUTS_4, "ep2_dp2_balanced"]


@pytest.fixture(scope="module")
def job4(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("expert-parallel-4")
    proc = run_script(_SCRIPT_4, out_dir, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out_dir / "results.pt", weights_only=True)


def _plain_4(run: dict) -> dict:
    return job4_module.plain_pytorch(run["initial"], run["load_replicas"], run["replicas"], run["balance"])


@pytest.mark.parametrize("layout", _TRAINED_4)
def test_on_4_processes_ep_trains_with_accumulation_and_clipping_to_the_weights_of_one_plain_process(
        job4, layout, assert_weights_match):
    run = job4[layout]
    expected = _plain_4(run)
    assert_weights_match(run["final"], expected["final"], run["initial"])
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    # One norm over the experts (on their own mesh) and the other weights, as clip_grad_norm_ computes it.
    assert run["norms"] == pytest.approx(expected["norms"], abs=1e-6)
    assert min(expected["norms"]) > job4_module.MAX_NORM, "no step was clipped; the test would prove little"


@pytest.mark.parametrize("layout", _TRAINED_4)
def test_on_4_processes_ep_gradients_are_those_of_one_plain_process(job4, layout):
    run = job4[layout]
    expected = _plain_4(run)["gradients"]
    assert run["gradients"].keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(run["gradients"][name], gradient, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("layout", _LAYOUTS_4)
def test_on_4_processes_expert_load_counts_the_global_batch_whatever_the_layout(job4, layout):
    # Rank 0's experts receive the tokens of its expert-parallel group: under EP 2 x data 2 those of
    # two of the four data-parallel processes, under EP 4 and EP 2 x tensor 2 the whole batch's. The
    # statistic adds the other group's (it counted half the batch under EP 2 x data 2).
    run = job4[layout]
    assert run["load_replicas"] == {"ep2_dp2": [0, 1], "ep4": [0, 1, 2, 3], "ep2_tp2": [0, 1]}[layout]
    whole_batch = job4_module.plain_pytorch(run["initial"], None, run["replicas"])["loads"]
    assert torch.equal(run["loads"], whole_batch), (run["loads"], whole_batch)
    assert int(run["loads"][0].sum()) == job4_module.GLOBAL_BATCH * job4_module.TOP_K


def test_on_4_processes_the_layouts_place_the_experts_as_asked(job4):
    names = ["expert_data_parallel", "expert_parallel", "tensor_parallel"]
    assert all(job4[layout]["dim_names"] == names for layout in _LAYOUTS_4)
    # EP 2 x data 2: 4 experts per expert-parallel process, FSDP2 halves them over "expert_data_parallel".
    assert job4["ep2_dp2"]["experts"] == {"dims": names[:2], "placements": ["_StridedShard(0)", "Shard(0)"],
                                          "local": [2, job4_module.HIDDEN, job4_module.FFN]}
    assert job4["ep4"]["experts"] == {"dims": ["expert_parallel"], "placements": ["Shard(0)"],
                                      "local": [2, job4_module.HIDDEN, job4_module.FFN]}
    # EP 2 x tensor 2: the experts whole on both processes of each tensor-parallel pair.
    assert job4["ep2_tp2"]["experts"] == {"dims": ["expert_parallel"], "placements": ["Shard(0)"],
                                          "local": [4, job4_module.HIDDEN, job4_module.FFN]}


_CONTEXT_4 = list(job4_module.CONTEXT_LAYOUTS)


@pytest.mark.parametrize("layout", _CONTEXT_4)
def test_on_4_processes_ep_under_context_parallelism_trains_to_one_plain_process(job4, layout, assert_weights_match):
    # MeshLayout(shard=2, context=2, expert=2 or 4): each process holds half of every position of its
    # replica's sequences; the experts take the tokens of every part. Losses, first gradients, the
    # global load per expert and the final weights are one plain process's on the whole sequences.
    run = job4[layout]
    assert run["positions"] == [job4_module.LENGTH // 2] * job4_module.STEPS  # each process half of each sequence
    expected = job4_module.plain_with_context(run["initial"], run["batches"])
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    assert run["gradients"].keys() == expected["gradients"].keys()
    for name, gradient in expected["gradients"].items():
        torch.testing.assert_close(run["gradients"][name], gradient, atol=1e-6, rtol=0, msg=name)
    assert torch.equal(run["loads"], expected["loads"]), (run["loads"], expected["loads"])
    assert_weights_match(run["final"], expected["final"], run["initial"])


def test_on_4_processes_ep_under_context_parallelism_borrows_whole_context_groups(job4):
    names = ["expert_data_parallel", "data_in_expert_parallel", "context_parallel", "tensor_parallel"]
    assert job4["ep2_cp2"]["dim_names"] == names and job4["ep4_cp2"]["dim_names"] == names
    # EP 2: 4 of the 8 experts on each process of a context group, FSDP2 halves them over the data pair.
    assert job4["ep2_cp2"]["experts"] == {"dims": ["expert_data_parallel", "expert_parallel"],
                                          "placements": ["_StridedShard(0)", "Shard(0)"],
                                          "local": [2, job4_module.HIDDEN, job4_module.FFN]}
    assert job4["ep4_cp2"]["experts"] == {"dims": ["expert_parallel"], "placements": ["Shard(0)"],
                                          "local": [2, job4_module.HIDDEN, job4_module.FFN]}


#: The pipelined runs and their MoE blocks: 2 stages of one block (1F1B), and 4 stages of one block,
#: 2 on each process (interleaved 1F1B).
_PIPELINED_4 = {"pp2_ep2": 2, "pp2x2_ep2": job4_module.INTERLEAVED_BLOCKS}


@pytest.mark.parametrize("run_name", _PIPELINED_4)
def test_on_4_processes_ep_under_a_pipeline_trains_to_one_plain_process(job4, run_name, assert_weights_match):
    # MeshLayout(pipeline=2, shard=2, expert=2): each stage's experts over its 2 processes, the
    # user's loop as under any pipeline; losses, clipped norms, first gradients and final weights of
    # every stage are those of one plain process on the same global batches (fp32, 1e-6).
    run = job4[run_name]
    expected = job4_module.plain_pipelined(run["initial"], _PIPELINED_4[run_name])
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    assert run["norms"] == pytest.approx(expected["norms"], abs=1e-6)
    assert min(expected["norms"]) > job4_module.MAX_NORM, "no step was clipped; the test would prove little"
    assert run["gradients"].keys() == expected["gradients"].keys()
    for name, gradient in expected["gradients"].items():
        torch.testing.assert_close(run["gradients"][name], gradient, atol=1e-6, rtol=0, msg=name)
    assert_weights_match(run["final"], expected["final"], run["initial"])
    # Then a forward-only schedule (under torch.no_grad()) on global batch 0.
    assert run["evaluation"] == pytest.approx(expected["evaluation"][0], abs=1e-6)


def test_on_4_processes_ep_under_a_pipeline_places_each_stages_experts_on_its_own_processes(job4):
    run = job4["pp2_ep2"]
    # Rank 0 holds the first stage (the embedding and block 0), half of block 0's experts.
    assert run["local_keys"] == ["blocks.0.experts.w1", "blocks.0.experts.w2", "blocks.0.router.weight",
                                 "embed.bias", "embed.weight"]
    assert run["experts"] == {"dims": ["expert_parallel"], "placements": ["Shard(0)"],
                              "local": [job4_module.EXPERTS // 2, job4_module.HIDDEN, job4_module.FFN]}
    # Interleaved: rank 0 holds stages 0 and 2 (the embedding, blocks 0 and 2), half of their experts.
    assert job4["pp2x2_ep2"]["local_keys"] == [
        f"blocks.{b}.{name}" for b in (0, 2) for name in ("experts.w1", "experts.w2", "router.weight")
    ] + ["embed.bias", "embed.weight"]


@pytest.mark.parametrize("run_name", _PIPELINED_4)
def test_on_4_processes_expert_load_under_a_pipeline_counts_each_blocks_global_batch(job4, run_name):
    # torch's stages infer their shapes by running each part once before the micro-batches (the
    # second stage on uninitialised tensors): that pass must not count in the first step's load,
    # nor in the evaluation's (a schedule of its own, the last row).
    run, blocks = job4[run_name], _PIPELINED_4[run_name]
    plain = job4_module.plain_pipelined(run["initial"], blocks)
    expected = torch.cat([plain["loads"], plain["evaluation"][1].unsqueeze(1)], dim=1)
    assert run["loads"].shape == (blocks, job4_module.STEPS + 1, job4_module.EXPERTS)
    assert torch.equal(run["loads"], expected), (run["loads"], expected)
    assert int(run["loads"][1, 0].sum()) == job4_module.GLOBAL_BATCH * job4_module.TOP_K


def test_a_checkpoint_saved_under_ep_and_a_pipeline_loads_on_one_plain_process(job4):
    from lite_core import LightningLite

    # Each stage's experts were sharded over its processes: the checkpoint holds every stage's
    # weights whole under the whole model's keys, and the optimizer's momentum for each of them.
    run = job4["pp2_ep2"]
    lite = LightningLite(accelerator="cpu", devices=1)
    torch.manual_seed(5)  # other weights than those saved: the load must replace every one
    model = job4_module.StackedMoE()
    model, optimizer = lite.setup(model, job4_module.make_optimizer(model))
    lite.load(run["checkpoint"], {"model": model, "optimizer": optimizer})
    assert model.state_dict().keys() == run["final"].keys()
    for name, value in run["final"].items():
        assert torch.equal(model.state_dict()[name], value), name
    assert len(optimizer.state_dict()["state"]) == len(run["final"])


def test_on_4_processes_every_data_parallel_process_sends_tokens_to_every_expert_process(job4):
    # Otherwise the all-to-all would skip a pair of processes and the comparison would prove less.
    model = job4_module.make_model()
    model.load_state_dict(job4["ep4"]["initial"])
    x, _ = job4_module.make_data()
    local = job4_module.EXPERTS // job4_module.WORLD
    for replica in range(job4_module.WORLD):
        with torch.no_grad():
            chosen = torch.cat([model.chosen(x[job4_module.rows(0, replica, job4_module.WORLD, micro)])
                                for micro in range(job4_module.ACCUMULATE)])
        assert set((chosen // local).flatten().tolist()) == {0, 1, 2, 3}, replica


def test_an_ep4_checkpoint_loads_under_ep2_and_on_one_plain_process_with_the_users_keys(job4):
    from torch.distributed.checkpoint import FileSystemReader

    from lite_core import LightningLite

    saved = job4["ep4"]["final"]
    # The experts whole ([8, ...], not each process's 2) under the model's own keys.
    metadata = FileSystemReader(job4["checkpoint"]).read_metadata().state_dict_metadata
    assert {key for key in metadata if key.startswith("model.")} == {f"model.{key}" for key in saved}
    assert metadata["model.experts.w1"].size == saved["experts.w1"].shape == (job4_module.EXPERTS, job4_module.HIDDEN,
                                                                              job4_module.FFN)
    moved = job4["moved"]
    assert moved["experts"]["local"][0] == 2  # EP 2 x data 2: a quarter of the experts on each process
    for name, value in saved.items():
        assert torch.equal(moved["loaded"][name], value), name
    lite = LightningLite(accelerator="cpu", devices=1)
    model = job4_module.make_model(seed=5)
    model, optimizer = lite.setup(model, job4_module.make_optimizer(model))
    lite.load(job4["checkpoint"], {"model": model, "optimizer": optimizer})
    assert model.state_dict().keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(model.state_dict()[name], value), name
    plain_logits = job4_module.logits(model)
    # Only rank 0 sent the probe's tokens: each expert computed on the rows one plain process does.
    torch.testing.assert_close(job4["ep4"]["logits"], plain_logits, atol=0, rtol=0)
    torch.testing.assert_close(moved["logits"], plain_logits, atol=0, rtol=0)
    # The momentum moved too: one more step under EP 2 x data 2 is one more plain step.
    loss, norm, _ = job4_module.plain_step(model, optimizer, 0)
    assert moved["loss"] == pytest.approx(loss, abs=1e-6) and moved["norm"] == pytest.approx(norm, abs=1e-6)
    final = {name: value.detach() for name, value in model.state_dict().items()}
    for name, value in final.items():
        torch.testing.assert_close(moved["final"][name], value, atol=1e-6, rtol=0, msg=name)
    assert max((final[name] - saved[name]).abs().max().item() for name in saved) > 1e-3  # the step moved them


@pytest.mark.parametrize(("case", "message"), [
    ("uneven", "The mesh dimension of size 4 does not divide the 6 experts of Experts: shard them over a dimension"
               " whose size divides the number of experts."),
    ("layout", "expert=3 does not divide the 4 data-parallel processes it borrows from: choose an expert that"
               " divides shard."),
    ("unaveraged", "The experts of 'experts' are sharded over 2 of the 4 data-parallel processes, so nothing averages"
                   " their gradients over the others: in parallelize_fn also apply fully_shard(experts,"
                   " mesh=device_mesh['expert_data_parallel']) after ExpertParallel, or shard them over"
                   " device_mesh['data_parallel']."),
])
def test_on_4_processes_what_ep_cannot_divide_or_average_is_refused_in_one_sentence(job4, case, message):
    assert job4["refusals"][case] == message
