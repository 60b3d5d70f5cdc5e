"""Expert parallelism (`lite_core.parallel.ExpertParallel`) on 2 real processes over gloo
(`tests/scripts/expert_parallel_job.py`): a tiny hand-written MoE with its experts sharded over the
data-parallel dimension (EP 2), each process on its own half of the global batch, ends where one
plain PyTorch process ends on the whole batch (AdamW, fp32, 1e-6); so does the same job with the
experts on the `"expert_parallel"` dimension of `MeshLayout(shard=2, expert=2)`, and a tiny Hugging
Face Qwen3-MoE whose experts module (transformers' own) is called as transformers calls it."""

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


_WAYS = ["data_parallel", "expert_parallel"]


@pytest.mark.parametrize("way", _WAYS)
def test_ep2_trains_to_the_weights_of_one_plain_process(job, way, assert_weights_match):
    job = job[way]
    expected = job_module.plain_pytorch(job["initial"])
    assert_weights_match(job["final"], expected["final"], job["initial"])
    assert job["losses"] == pytest.approx(expected["losses"], abs=1e-6)


@pytest.mark.parametrize("way", _WAYS)
def test_ep2_gradients_are_those_of_one_plain_process(job, way):
    job = job[way]
    # Expert gradients are summed over the tokens of both processes and non-expert ones averaged:
    # both must come out as one process's gradient over the whole batch (AdamW would hide a factor).
    expected = job_module.plain_pytorch(job["initial"])["gradients"]
    assert job["gradients"].keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(job["gradients"][name], gradient, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("way", _WAYS)
def test_expert_load_counts_each_experts_tokens_over_every_process_as_one_process_sees_them(job, way):
    run = job[way]
    expected = job_module.plain_pytorch(run["initial"])["loads"]
    assert run["loads"].shape == (job_module.STEPS, job_module.EXPERTS)
    assert torch.equal(run["loads"], expected), (run["loads"], expected)
    assert int(run["loads"][0].sum()) == job_module.GLOBAL_BATCH * job_module.TOP_K


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
])
def test_what_expert_parallel_cannot_shard_or_call_is_refused_in_one_sentence(job, case, message):
    assert job["refusals"][case] == message


def test_experts_computed_by_grouped_mm_give_under_ep2_what_they_give_whole(job):
    # bfloat16 (torch._grouped_mm on CPU): the same products on the same rows, wherever they run.
    result = job["grouped"]
    assert result["whole"].shape[0] > 0
    torch.testing.assert_close(result["sharded"], result["whole"])
    torch.testing.assert_close(result["sharded_grad"], result["whole_grad"])


def test_a_hugging_face_qwen3_moe_under_ep2_trains_as_one_plain_process(job, assert_weights_match):
    # transformers' Qwen3MoeExperts is called experts(hidden_states, top_k_index, top_k_weights) and
    # loops over its stacked experts itself: ExpertParallel takes that call as it is.
    run = job["qwen3_moe"]
    assert run["local_experts"] == job_module.EXPERTS // job_module.WORLD  # each process holds half the experts
    expected = job_module.plain_qwen3_moe(run["initial"])
    assert run["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    assert_weights_match(run["final"], expected["final"], run["initial"])


def test_an_ep2_checkpoint_loads_whole_on_one_process_and_its_export_in_transformers(job):
    # The experts were DTensors sharded over the processes; the checkpoint holds them whole under
    # the model's own keys, and the export in Hugging Face's layout (stacked experts) loads in
    # transformers' own from_pretrained.
    from transformers import Qwen3MoeForCausalLM

    from lite_core import LightningLite

    run = job["qwen3_moe"]
    lite = LightningLite(accelerator="cpu", devices=1)
    model = lite.setup(job_module.make_qwen3_moe())
    lite.load(run["checkpoint"], {"model": model})
    loaded = model.state_dict()
    assert loaded.keys() == run["final"].keys()
    for name, value in run["final"].items():
        assert torch.equal(loaded[name], value), name
    exported = Qwen3MoeForCausalLM.from_pretrained(run["export"])
    tokens = job_module.qwen_tokens()[:2]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, model(input_ids=tokens).logits, atol=0, rtol=0)
