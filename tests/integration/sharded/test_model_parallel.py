"""`model_parallel` (tensor parallel x FSDP2 on a 2-D mesh) and HSDP on 4 real processes over gloo,
compared with one plain PyTorch process: training under three layouts, data by data-parallel rank,
clipping over parameters of two meshes, `empty_init`, precisions, and checkpoints that move between
layouts and strategies. One job (`tests/scripts/model_parallel_job.py`) runs every check."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.checkpoint import consolidate, is_sharded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_parallel_job.py"
_spec = importlib.util.spec_from_file_location("model_parallel_job", _SCRIPT)
job_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_module)  # the job's model, data and constants


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("model-parallel")
    proc = run_script(_SCRIPT, out_dir, timeout=200)
    assert proc.returncode == 0, output_of(proc)
    results = torch.load(out_dir / "results.pt", weights_only=True)
    results["out_dir"] = out_dir
    return results


def plain_pytorch(initial: dict, precision: str = "32-true", clip: bool = True) -> tuple[dict, list[float]]:
    """One process, SGD over the same consecutive global batches, clipped with `clip_grad_norm_`."""
    dtype = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}[precision]
    mixed = precision.endswith("-mixed")
    model = job_module.MLP()
    model.load_state_dict(initial)
    model = model if mixed else model.to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=job_module.LR)
    x, y = job_module.make_data()
    norms = []
    for start in range(0, len(x), job_module.GLOBAL_BATCH):
        xb, yb = x[start:start + job_module.GLOBAL_BATCH], y[start:start + job_module.GLOBAL_BATCH]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype) if mixed else contextlib.nullcontext():
            out = model(xb if mixed else xb.to(dtype))
        nn.functional.mse_loss(out, yb).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job_module.MAX_NORM).item())
        optimizer.step()
    return {k: v.float() for k, v in model.state_dict().items()}, norms


def assert_close_and_moved(actual: dict, expected: dict, initial: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=name)
    moved = max((expected[n] - initial[n].float()).abs().max().item() for n in expected if n != "scale")
    assert moved > 5 * atol, "training barely changed the weights; the comparison would prove nothing"


@pytest.mark.parametrize("layout", ["2x2", "1x4", "4x1"])
def test_training_with_clipping_matches_one_plain_process(job, layout):
    run = job[f"train_{layout}"]
    expected, norms = plain_pytorch(run["initial"])
    assert_close_and_moved(run["final"], expected, run["initial"], atol=1e-5)
    # One global norm over parameters on the 2-D mesh and on the data-parallel submesh.
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms), atol=1e-5, rtol=0)
    assert sum(n > job_module.MAX_NORM for n in norms) >= 2, "clipping hardly happened; the test would prove nothing"


def test_parallelised_parameters_live_on_two_meshes(job):
    params = job["train_2x2"]["params"]
    assert params["up.weight"].count("Shard") == 2  # data and tensor parallel
    assert params["head.weight"] == "DTensor(Shard(dim=0),)"  # data parallel only


@pytest.mark.parametrize(("layout", "dp", "tp"), [("2x2", 2, 2), ("1x4", 1, 4), ("4x1", 4, 1)])
def test_ranks_of_one_tensor_parallel_group_get_the_same_batches(job, layout, dp, tp):
    batches = job[f"train_{layout}"]["batches"]  # every rank's first batch, by global rank
    first_global = job_module.make_data()[0][:job_module.GLOBAL_BATCH]
    for rank in range(4):
        data_rank = rank // tp  # the mesh is (data_parallel, tensor_parallel), row-major
        torch.testing.assert_close(batches[rank], first_global[data_rank::dp], atol=0, rtol=0)


@pytest.mark.parametrize(("layout", "dp", "tp"), [("2x2", 2, 2), ("1x4", 1, 4), ("4x1", 4, 1)])
def test_split_batches_gives_a_tensor_parallel_group_one_part_of_the_plain_batch(job, layout, dp, tp):
    # setup_dataloaders(split_batches=True): the loader's batch is the global batch, cut into one
    # contiguous part per data-parallel rank; the ranks of one tensor-parallel group share a part.
    parts = job[f"train_{layout}"]["split"]  # every rank's part, by global rank
    loader = DataLoader(TensorDataset(*job_module.make_data()), batch_size=job_module.GLOBAL_BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(job_module.SPLIT_SEED))
    plain_first = next(iter(loader))[0]
    size = job_module.GLOBAL_BATCH // dp
    for rank in range(4):
        data_rank = rank // tp
        torch.testing.assert_close(parts[rank], plain_first[data_rank * size:(data_rank + 1) * size], atol=0, rtol=0)


def test_the_mesh_groups_can_be_passed_to_the_collectives(job):
    # Rank 0's tensor-parallel group on dp2 x tp2 is ranks {0, 1}; the world is {0, 1, 2, 3}.
    assert job["train_2x2"]["tp_sum"].item() == 1.0
    assert job["train_2x2"]["world_sum"].item() == 6.0


def test_empty_init_builds_on_meta_and_equals_a_normal_build(job):
    run = job["empty_init"]
    assert run["on_meta"], "init_module(empty_init=True) allocated real parameters"
    # up.weight (16 x 8) is split by 2 tensor- and 2 data-parallel ranks; head.weight (8 x 8) by 2.
    assert run["local_numel"]["up.weight"] == 32
    assert run["local_numel"]["head.weight"] == 32
    torch.manual_seed(7)
    normal = job_module.MLP().state_dict()
    assert run["final"].keys() == normal.keys()
    for name, tensor in normal.items():
        assert torch.equal(run["final"][name], tensor), name
    assert torch.equal(run["scale"], torch.linspace(0.5, 1.5, 8))  # a buffer computed in __init__


def test_setup_module_then_setup_optimizers_trains_and_refuses_a_foreign_optimizer(job):
    run = job["empty_init"]
    torch.manual_seed(7)
    model = job_module.MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=job_module.LR)
    nn.functional.mse_loss(model(job_module.X), job_module.Y).backward()
    optimizer.step()
    assert_close_and_moved(run["stepped"], model.state_dict(), run["final"], atol=1e-6)
    assert run["foreign_optimizer"] == ("This optimizer updates no model set up by strategy='model_parallel': create it"
                                        " from the parameters of the model returned by setup_module().")


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16-mixed", 1e-4), ("bf16-true", 2e-3)])
def test_precisions_match_plain_pytorch_in_the_same_precision(job, precision, tolerance):
    # Tensor parallelism rounds each split matmul's bfloat16 result before summing the parts, so the
    # runs agree to bfloat16 rounding (bf16-true: one step of bfloat16 at these weights, 2^-9).
    run = job[f"precision_{precision}"]
    expected, _ = plain_pytorch(run["initial"], precision, clip=False)
    float32, _ = plain_pytorch(run["initial"], "32-true", clip=False)
    assert_close_and_moved(run["final"], expected, run["initial"], atol=tolerance)
    # The precision really applied: a float32 run is within 1e-6 of plain float32 (see above).
    assert max((run["final"][n] - float32[n]).abs().max().item() for n in float32) > 1e-5


def test_hsdp_shards_within_groups_replicates_across_them_and_matches_one_process(job):
    run = job["hsdp"]
    assert set(run["params"].values()) == {"DTensor(Replicate(), Shard(dim=0))"}
    expected, norms = plain_pytorch(run["initial"])
    assert_close_and_moved(run["final"], expected, run["initial"], atol=1e-5)
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("moved", "expected"), [
    ("from_sharded_on_1x4", "S3"),  # dp2 x tp2 -> dp1 x tp4
    ("from_full_on_4x1", "S3"),  # one file -> dp4 x tp1
    ("from_sharded_on_fsdp", "S3"),
    ("from_sharded_on_ddp", "S3"),
    ("from_fsdp_on_1x4", "S4"),  # an fsdp checkpoint resumes a model-parallel run
    ("from_ddp_on_4x1", "S4"),  # and a ddp one
])
def test_two_models_and_optimizers_resume_under_another_layout_or_strategy(job, moved, expected):
    resumed = job["resume"]
    assert resumed[moved]["step"] == (2 if expected == "S3" else 3)
    for model in ("model", "model2"):
        for name, tensor in resumed[expected][model].items():
            torch.testing.assert_close(resumed[moved][model][name], tensor, atol=1e-5, rtol=0, msg=f"{model}.{name}")
    # Adam's state travelled: a fresh optimizer's first step would move every weight by about lr.
    before = resumed["S3"]["model"]["up.weight"] - resumed["S4"]["model"]["up.weight"]
    assert before.abs().max() > 1e-3


class _Resume(LightningLite):
    def run(self, path: Path) -> dict:
        state = {**self.two_models(), "step": 0}
        self.load(path, state)
        return job_module.step(self, state)

    def two_models(self) -> dict:
        return job_module.two_models(self, seed=50)


@pytest.mark.parametrize("kind", ["mp_sharded", "mp_full.pt", "consolidated.pt"])
def test_a_model_parallel_checkpoint_resumes_on_one_device(job, kind):
    out_dir = job["out_dir"]
    assert is_sharded(out_dir / "mp_sharded") and not is_sharded(out_dir / "mp_full.pt")
    if kind == "consolidated.pt":
        consolidate(out_dir / "mp_sharded", out_dir / kind)
    weights = _Resume(accelerator="cpu", strategy="single_device").run(out_dir / kind)
    for model in ("model", "model2"):
        for name, tensor in job["resume"]["S3"][model].items():
            torch.testing.assert_close(weights[model][name], tensor, atol=1e-5, rtol=0, msg=f"{model}.{name}")


def test_bad_input_that_needs_processes_gets_one_sentence(job):
    errors = job["errors"]
    assert errors["not_a_module"] == ("parallelize_fn returned NoneType, not a module: return the parallelised"
                                      " model from parallelize_fn(model, device_mesh).")
    assert errors["uneven"].startswith("tensor_parallel_size=4 does not divide dimension 0 (of size 6) of"
                                       " parameter 'proj.weight' in layer 'proj':")
    assert all(message.count(". ") == 0 and message.endswith(".") for message in errors.values())
