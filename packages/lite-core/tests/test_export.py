"""`export_safetensors` in one process: a tiny GPT-2 (its head tied to the input embedding) that
`transformers`' `from_pretrained` loads back, from a folder and from a `memory://` URL, and the
arguments refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from lite_core import LightningLite
from lite_core.errors import CheckpointError, ConfigurationError

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _assert_same_model(folder: Path, plain: torch.nn.Module) -> None:
    plain.config.save_pretrained(folder)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, plain(tokens).logits)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again on loading


def test_an_export_loads_in_transformers_with_the_tied_head_left_out(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    plain = _gpt2()
    model = lite.setup(plain)
    lite.export_safetensors(model, tmp_path, max_file_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1  # files of at most 30 kB: several
    assert {path.name for path in tmp_path.iterdir()} == {"model.safetensors.index.json",
                                                          *index["weight_map"].values()}
    _assert_same_model(tmp_path, plain)


def test_an_export_to_a_url_is_put_into_the_store(tmp_path: Path) -> None:
    import fsspec

    lite = LightningLite(accelerator="cpu")
    plain = _gpt2()
    url = f"memory://exports/{uuid.uuid4().hex[:8]}"
    lite.export_safetensors(lite.setup(plain), url)
    fs = fsspec.filesystem("memory")
    names = sorted(Path(name).name for name in fs.ls(url, detail=False))
    assert names == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    fs.get(f"{url}/", str(tmp_path), recursive=True)
    _assert_same_model(tmp_path, plain)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(_gpt2())
    with pytest.raises(ConfigurationError, match="max_file_bytes=0 is not a size"):
        lite.export_safetensors(model, tmp_path / "zero", max_file_bytes=0)
    with pytest.raises(CheckpointError, match="nosuchstore"):
        lite.export_safetensors(model, "nosuchstore://bucket/export")
    assert not (tmp_path / "zero").exists()


def test_a_missing_safetensors_is_named_with_its_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from lite_core.errors import MissingDependencyError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else find_spec(name, *a))
    lite = LightningLite(accelerator="cpu")
    with pytest.raises(MissingDependencyError, match=r"pip install 'safetensors>=0\.4'"):
        lite.export_safetensors(lite.setup(_gpt2()), tmp_path / "export")
    assert not (tmp_path / "export").exists()


# -- load_safetensors: what transformers saved, into a set-up model -----------------------------
def test_what_transformers_saved_loads_into_the_set_up_model_with_the_head_still_tied(tmp_path: Path) -> None:
    saved = _gpt2()
    saved.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and their index
    lite = LightningLite(accelerator="cpu")
    with lite.init_module(empty_init=True):
        torch.manual_seed(1)  # other weights than the saved ones until the load
        fresh = transformers.GPT2LMHeadModel(saved.config).eval()
    model = lite.setup(fresh)
    lite.load_safetensors(model, tmp_path)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, saved(tokens).logits)


def test_files_of_another_model_are_refused_naming_the_weights_they_lack(tmp_path: Path) -> None:
    saved = _gpt2()
    saved.save_pretrained(tmp_path)  # one file, model.safetensors
    other = transformers.GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=101, n_positions=16)
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(transformers.GPT2LMHeadModel(other))
    with pytest.raises(CheckpointError, match=r"hold no weight for \d+ of the \d+ weights of GPT2LMHeadModel,"
                                              r" such as 'transformer.h.2.") as info:
        lite.load_safetensors(model, tmp_path)
    assert str(info.value).endswith(".") and ". " not in str(info.value)


def test_a_url_and_a_folder_without_safetensors_are_refused(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(_gpt2())
    with pytest.raises(CheckpointError, match="reads a local folder, not 'memory://hf/gpt2': download"):
        lite.load_safetensors(model, "memory://hf/gpt2")
    with pytest.raises(CheckpointError, match="No safetensors model in"):
        lite.load_safetensors(model, tmp_path)


def test_a_strategy_that_holds_weights_its_own_way_refuses(tmp_path: Path) -> None:
    from lite_core.strategies.single_device import SingleDeviceStrategy

    class OwnWeights(SingleDeviceStrategy):
        loads_safetensors = False

    lite = LightningLite(accelerator="cpu", strategy=OwnWeights())
    model = lite.setup(_gpt2())
    with pytest.raises(CheckpointError, match="holds its modules' weights its own way"):
        lite.load_safetensors(model, tmp_path)
