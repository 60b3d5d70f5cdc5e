"""`ModelParallelStrategy(mesh=MeshLayout(...))` trains exactly as the same job configured with the
size keywords, on 2 real processes over gloo (`tests/scripts/mesh_layout_job.py`): a pipeline and
tensor parallelism, the same named mesh, the same losses and final weights to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mesh_layout_job.py"


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("mesh-layout")
    # Several processes on a small machine import torch slowly: the store waits longer than usual.
    proc = run_script(_SCRIPT, out_dir, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out_dir / "results.pt", weights_only=True)


@pytest.mark.parametrize(("layout", "names", "shape"), [
    ("pp2", ["pipeline_parallel", "data_parallel", "tensor_parallel"], [2, 1, 1]),
    ("tp2", ["data_parallel", "tensor_parallel"], [1, 2]),
])
def test_a_mesh_layout_trains_as_the_size_keywords_do(job, layout, names, shape):
    keywords, mesh = job[layout]["keywords"], job[layout]["mesh"]
    assert keywords["dim_names"] == mesh["dim_names"] == names
    assert keywords["shape"] == mesh["shape"] == shape
    assert keywords["final"].keys() == mesh["final"].keys()
    for name, value in keywords["final"].items():
        assert torch.equal(mesh["final"][name], value), name
    assert [loss.tolist() for loss in mesh["losses"]] == [loss.tolist() for loss in keywords["losses"]]
    assert mesh["norms"] == keywords["norms"]
    moved = max((value - keywords["initial"][name].float()).abs().max().item()
                for name, value in keywords["final"].items())
    assert moved > 1e-3, "training barely changed the weights; the comparison would prove nothing"
