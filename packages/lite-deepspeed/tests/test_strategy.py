"""Construction of the DeepSpeed strategy: presets, config, precision, and one-sentence errors."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import run_fresh  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.errors import ConfigurationError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lite_deepspeed") is None or importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed here: these tests run in `hatch run test-deepspeed:all`",
)

PRESETS = {
    "deepspeed": (2, False, False),
    "deepspeed_stage_1": (1, False, False),
    "deepspeed_stage_2": (2, False, False),
    "deepspeed_stage_2_offload": (2, True, False),
    "deepspeed_stage_3": (3, False, False),
    "deepspeed_stage_3_offload": (3, True, True),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_registered_with_their_zero_settings(name):
    strategy = LightningLite(accelerator="cpu", strategy=name, devices=2).strategy
    stage, offload_optimizer, offload_parameters = PRESETS[name]
    zero = strategy.config["zero_optimization"]
    assert strategy.name == name and strategy.stage == stage
    assert ("offload_optimizer" in zero) is offload_optimizer
    assert ("offload_param" in zero) is offload_parameters
    assert type(strategy.launcher).__name__ == "ScriptLauncher"  # the DDP launcher, reused


def test_keyword_options_build_the_config():
    from lite_deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, reduce_bucket_size=1000, overlap_comm=False)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1000 and zero["overlap_comm"] is False
    assert zero["offload_optimizer"]["device"] == "cpu"


def test_a_json_config_path_is_read(tmp_path):
    from lite_deepspeed import DeepSpeedStrategy

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 3}))
    lite = LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(config=path), devices=2)
    strategy = lite.strategy
    assert strategy.stage == 1
    full = strategy._full_config(lite._plan.precision.name)
    assert full["train_micro_batch_size_per_gpu"] == 3  # the user's batch size is kept
    assert full["gradient_clipping"] == 0.0  # Lite clips only when asked


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


_NO_FP16 = pytest.mark.skipif("not _cpu_has_fp16()", reason="this CPU has no float16 that DeepSpeed accepts"
                                                             " (AVX512-FP16 or AMX-FP16)")


@pytest.mark.parametrize(("precision", "section"), [pytest.param("16-mixed", "fp16", marks=_NO_FP16),
                                                    ("bf16-mixed", "bf16"), ("bf16-true", "bf16")])
def test_precision_maps_onto_deepspeed_sections(precision, section):
    lite = LightningLite(accelerator="cpu", strategy="deepspeed", devices=2, precision=precision)
    assert lite.strategy._full_config(lite._plan.precision.name)[section] == {"enabled": True}
    assert type(lite._plan.precision).__name__ == "DeepSpeedPrecision"


def test_fp16_on_a_cpu_without_it_is_refused_at_construction():
    if _cpu_has_fp16():
        assert LightningLite(accelerator="cpu", strategy="deepspeed", devices=2, precision="16-mixed")
        return
    with pytest.raises(ConfigurationError) as err:  # DeepSpeed raised inside deepspeed.initialize
        LightningLite(accelerator="cpu", strategy="deepspeed", devices=2, precision="16-mixed")
    assert _one_sentence(err.value).startswith("precision='16-mixed' needs float16 support that DeepSpeed does not"
                                               " find on accelerator='cpu' here")


def test_32_true_adds_no_low_precision_section():
    lite = LightningLite(accelerator="cpu", strategy="deepspeed", devices=2)
    full = lite.strategy._full_config(lite._plan.precision.name)
    assert "fp16" not in full and "bf16" not in full


def _one_sentence(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith((".", "?", "`.")), text
    return text


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_other_precisions_are_refused(precision):
    with pytest.raises(ConfigurationError, match="is not supported by strategy='deepspeed'") as err:
        LightningLite(accelerator="cpu", strategy="deepspeed", devices=2, precision=precision)
    _one_sentence(err.value)


def test_unsupported_accelerator_names_the_supported_ones(monkeypatch):
    monkeypatch.setenv("LITE_FAKE_AVAILABLE", "1")  # the test backend's accelerator, made available
    with pytest.raises(ConfigurationError, match=r"does not run on accelerator='fake': choose one of \['cpu', 'cuda'\]") as err:
        LightningLite(accelerator="fake", strategy="deepspeed_stage_3", devices=1)
    _one_sentence(err.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": {"zero_optimisation": {"stage": 3}}}, "did you mean 'zero_optimization'"),
    ({"config": {"zero_optimization": {"stage": 5}}}, "zero_optimization.stage=5"),
    ({"config": {"zero_optimization": {"stage": 2}}, "stage": 3}, "got both config and"),
    ({"stage": 1, "offload_optimizer": True}, "cannot offload the optimizer"),
    ({"stage": 2, "offload_parameters": True}, "cannot offload parameters"),
    ({"config": "/no/such/ds_config.json"}, "is not a file"),
])
def test_bad_configuration_fails_at_construction(kwargs, message):
    from lite_deepspeed import DeepSpeedStrategy

    with pytest.raises(ConfigurationError, match=message) as err:
        DeepSpeedStrategy(**kwargs)
    _one_sentence(err.value)


def test_bad_zero_keys_are_caught_by_deepspeed_models_at_construction():
    from lite_deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config={"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}})
    with pytest.raises(ConfigurationError, match="zero_optimization section is not valid") as err:
        LightningLite(accelerator="cpu", strategy=strategy, devices=2)
    _one_sentence(err.value)


def test_config_contradicting_the_precision_is_refused():
    from lite_deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigurationError, match="enables fp16 but precision='bf16-mixed'") as err:
        LightningLite(accelerator="cpu", strategy=strategy, devices=2, precision="bf16-mixed")
    _one_sentence(err.value)


def test_missing_deepspeed_package_is_one_sentence():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from lite_core import LightningLite\n"
        "try:\n    LightningLite(accelerator='cpu', strategy='deepspeed', devices=2)\n"
        "except Exception as err:\n    print(type(err).__name__, '|', err)\n"
    )
    out = run_fresh(code)  # not forked from the test session's server: it preloads deepspeed
    name, message = out.stdout.strip().split(" | ", 1)
    assert name == "ConfigurationError", out.stdout + out.stderr
    assert "needs the deepspeed package" in message and "pip install --no-build-isolation deepspeed" in message
    assert "\n" not in message


def test_importing_the_package_imports_no_deepspeed():
    code = "import sys, lite_deepspeed, lite_deepspeed.presets; print('deepspeed' in sys.modules)"
    out = run_fresh(code)  # not forked from the test session's server: it preloads deepspeed
    assert out.stdout.strip() == "False", out.stderr


def test_a_background_save_falls_back_to_a_blocking_one_and_says_why():
    strategy = LightningLite(accelerator="cpu", strategy="deepspeed_stage_2", devices=2).strategy
    reason = strategy.why_no_background_save()
    assert reason is not None and "engine.save_checkpoint" in reason and "\n" not in reason


def test_a_url_is_refused_in_one_sentence_as_deepspeed_writes_local_files_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from lite_core.errors import CheckpointError

    lite = LightningLite(accelerator="cpu", strategy="deepspeed", devices=2)
    with pytest.raises(CheckpointError, match="strategy='deepspeed' writes and reads checkpoints on the local file"
                                              " system only") as info:
        lite.load("s3://bucket/run/ckpt")
    assert str(info.value).endswith(".") and ". " not in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(480)  # a hang guard: about 18 s idle, 125 s seen beside a fresh-clone CI run at load 10
def test_a_deepspeed_checkpoint_that_runs_code_is_refused_by_every_reader(run_script, output_of, tmp_path):
    """DeepSpeed reads its files with weights_only=False: Lite checks them with safe loading first,
    under deepspeed and when another strategy reads the folder whole (scripts/hostile_checkpoint.py)."""
    script = Path(__file__).parent / "scripts" / "hostile_checkpoint.py"
    proc = run_script(command=[sys.executable, str(script), str(tmp_path)], timeout=420)
    assert proc.returncode == 0, output_of(proc)
    for check in ("refused under deepspeed", "refused under single_device", "refused by load(path)",
                  "weights_only=False reads it as DeepSpeed does"):
        assert f"OK {check}" in proc.stdout, output_of(proc)


@pytest.mark.timeout(480)  # a hang guard: three DeepSpeed starts in one process (the hostile script's are 11-184 s)
def test_a_checkpoint_of_another_model_is_refused_naming_the_weights_of_another_shape(run_script, output_of, tmp_path):
    """Under DeepSpeed's reader and Lite's whole reader (ZeRO-3), a weight of another shape is named in
    one sentence, even where its number of elements is the same; a save before the optimizer's first
    step reads under another layout (scripts/mismatch.py)."""
    script = Path(__file__).parent / "scripts" / "mismatch.py"
    proc = run_script(command=[sys.executable, str(script), str(tmp_path)], timeout=420)
    assert proc.returncode == 0, output_of(proc)
    for check in ("refused by deepspeed's reader", "refused by the whole reader",
                  "a save before the first step loads under another layout"):
        assert f"OK {check}" in proc.stdout, output_of(proc)
