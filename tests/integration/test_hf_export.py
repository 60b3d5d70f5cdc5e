"""`export_safetensors`: a tiny Llama trained under fsdp (2 processes) and under model parallel
(data 2 x tensor 2, 4 processes), exported, and loaded by `transformers`' `from_pretrained` with
the trained weights and their logits; from a bucket too (moto's S3 server on 127.0.0.1). A
planted fault, a file left out of the index, fails the same check. And `load_safetensors`: what
`transformers` saved, loaded in the same jobs into a model built on the meta device and sharded,
equals `from_pretrained`'s weights and logits while no process held the whole model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# A hang guard, far above a job's duration (about 40 s for 4 processes on 2 shared cores).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def assert_loads_as_trained(folder: Path, out: Path) -> None:
    """`from_pretrained(folder)` holds the job's trained weights and gives their logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    trained = torch.load(out / "trained.pt", weights_only=True)
    shutil.copy(out / "config.json", folder / "config.json")
    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    state = loaded.state_dict()
    assert sorted(state) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), f"{name} differs from the trained weight"
    reference = LlamaForCausalLM(LlamaConfig.from_pretrained(out)).eval()
    reference.load_state_dict(trained)
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)


@pytest.fixture(scope="module")
def jobs(run_script: Any, output_of: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Path] = {}

    def job(strategy: str, *url: str, env: dict[str, str] | None = None) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(f"export-{strategy}")
            proc = run_script("export_hf.py", strategy, out, *url, env=env, timeout=300)
            assert proc.returncode == 0, output_of(proc)
            done[strategy] = out
        return done[strategy]

    return job


def test_an_fsdp_export_loads_in_transformers_from_a_folder_and_from_a_bucket(
        jobs: Any, s3_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    import fsspec

    out = jobs("fsdp", f"{s3_bucket}/llama", env=s3_server.env)
    files = sorted(path.name for path in (out / "export").iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 2, files  # several files and their index
    assert_loads_as_trained(out / "export", out)
    fs = fsspec.filesystem("s3")
    assert sorted(Path(name).name for name in fs.ls(f"{s3_bucket}/llama", detail=False)) == files
    fs.get(f"{s3_bucket}/llama/", str(tmp_path / "from-bucket"), recursive=True)
    assert_loads_as_trained(tmp_path / "from-bucket", out)


def test_a_model_parallel_export_loads_in_transformers(jobs: Any) -> None:
    out = jobs("model_parallel")
    assert_loads_as_trained(out / "export", out)


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_what_transformers_saved_loads_into_a_sharded_model_that_no_process_holds_whole(
        jobs: Any, s3_server: Any, s3_bucket: str, strategy: str) -> None:
    from transformers import LlamaForCausalLM

    out = jobs(strategy, f"{s3_bucket}/llama", env=s3_server.env) if strategy == "fsdp" else jobs(strategy)
    saved = LlamaForCausalLM.from_pretrained(out / "saved_by_transformers").eval()
    assert len(list((out / "saved_by_transformers").glob("*.safetensors"))) > 1  # several files and an index
    record = torch.load(out / "loaded.pt", weights_only=True)
    assert sorted(record["state"]) == sorted(saved.state_dict())
    for name, tensor in saved.state_dict().items():
        assert torch.equal(record["state"][name], tensor), f"{name} differs from what transformers saved"
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # tensor parallel sums partial products in another order
        torch.testing.assert_close(record["logits"], saved(tokens).logits, rtol=0, atol=1e-5)
    # built on the meta device and loaded in place: rank 0 held a part of the model, never all of it
    assert record["on_meta"] and record["held"] <= 0.6 * record["whole"], (record["on_meta"], record["held"] / record["whole"])


def test_a_file_left_out_of_the_index_fails_the_check(jobs: Any, tmp_path: Path) -> None:
    """The planted fault: the check above must notice an export missing one file."""
    out = jobs("model_parallel")
    broken = tmp_path / "broken"
    shutil.copytree(out / "export", broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    left_out = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {name: file for name, file in index["weight_map"].items() if file != left_out}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    (broken / left_out).unlink()
    with pytest.raises(AssertionError):
        assert_loads_as_trained(broken, out)
