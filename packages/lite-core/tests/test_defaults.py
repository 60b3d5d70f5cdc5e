"""Constructor defaults from the environment (`lite run`): precedence, warnings, bad values,
and the process counts that an external launcher exports."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lite_core.connector._defaults import VARIABLES
from lite_core.environments.local import LocalEnvironment
from lite_core.errors import ConfigurationError
from lite_core.lite import LightningLite


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [*VARIABLES.values(), "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"]:
        monkeypatch.delenv(variable, raising=False)


def test_signature_still_shows_the_documented_defaults() -> None:
    parameters = inspect.signature(LightningLite).parameters
    shown = {name: parameters[name].default for name in VARIABLES}
    assert shown == {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1,
                     "precision": "32-true"}


def test_without_variables_the_defaults_apply() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lite = LightningLite()
    assert lite.strategy.name == "single_device"
    assert lite._plan.precision.name == "32-true"


def test_variables_supply_the_arguments_the_code_leaves_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_ACCELERATOR", "cpu")
    monkeypatch.setenv("LITE_STRATEGY", "ddp_spawn")
    monkeypatch.setenv("LITE_DEVICES", "3")
    monkeypatch.setenv("LITE_PRECISION", "bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lite = LightningLite()
    assert lite.strategy.name == "ddp_spawn"
    assert lite.strategy.device_indexes == [0, 1, 2]
    assert lite._plan.precision.name == "bf16-mixed"
    assert lite.strategy.accelerator is not None and lite.strategy.accelerator.name == "cpu"


def test_num_nodes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_NUM_NODES", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("NODE_RANK", "1")
    lite = LightningLite(accelerator="cpu")
    assert lite.strategy.num_nodes == 2 and lite.strategy.name == "ddp"


def test_explicit_argument_wins_and_the_warning_names_the_ignored_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_DEVICES", "2")
    monkeypatch.setenv("LITE_PRECISION", "bf16-mixed")
    with pytest.warns(UserWarning) as record:
        lite = LightningLite(accelerator="cpu", devices=1, precision="64-true")
    assert lite.strategy.device_indexes == [0]
    assert lite._plan.precision.name == "64-true"
    messages = sorted(str(w.message) for w in record)
    assert messages == [
        "LITE_DEVICES='2' is ignored because the code passes devices=1: remove the argument from"
        " LightningLite(...) to let the command line or environment choose it.",
        "LITE_PRECISION='bf16-mixed' is ignored because the code passes precision='64-true': remove the"
        " argument from LightningLite(...) to let the command line or environment choose it.",
    ]
    assert all(w.filename == __file__ for w in record)  # points at the user's line


def test_explicit_value_equal_to_the_variable_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_DEVICES", "1")
    monkeypatch.setenv("LITE_STRATEGY", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LightningLite(devices=1, strategy="auto")


def test_explicit_auto_is_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_ACCELERATOR", "fake")  # would fail: the fake accelerator is unavailable
    with pytest.warns(UserWarning, match="LITE_ACCELERATOR='fake' is ignored"):
        lite = LightningLite(accelerator="auto")
    assert lite.strategy.accelerator is not None and lite.strategy.accelerator.name == "cpu"


def test_bad_num_nodes_variable_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_NUM_NODES", "two")
    with pytest.raises(ConfigurationError, match=r"^LITE_NUM_NODES='two' is not a number of nodes: set it to a"
                                                 r" positive integer\.$"):
        LightningLite()


def test_bad_variable_value_fails_like_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_STRATEGY", "dpp")
    with pytest.raises(ConfigurationError, match="did you mean 'ddp'"):
        LightningLite()


# -- process counts exported by an external launcher --------------------------------------------------
def test_launcher_process_counts_must_match_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    environment = LocalEnvironment()
    environment.validate_settings(4, 1)
    with pytest.raises(ConfigurationError, match=r"started 4 process\(es\) per node and 4 in total but"
                                                 r" LightningLite\(devices=2, num_nodes=1\) expects 2 and 2"):
        environment.validate_settings(2, 1)
    with pytest.raises(ConfigurationError, match="lite run --devices 4 --num-nodes 2"):
        environment.validate_settings(4, 2)


def test_process_counts_are_not_checked_without_an_external_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # e.g. left over by Lite's own script launcher
    LocalEnvironment().validate_settings(2, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")  # started externally, but by a launcher that says nothing
    LocalEnvironment().validate_settings(2, 1)


def test_lite_run_processes_with_code_asking_for_other_devices_fail_at_construction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LITE_DEVICES", "2")
    with pytest.warns(UserWarning, match="LITE_DEVICES='2' is ignored"), \
            pytest.raises(ConfigurationError, match="leave devices and num_nodes out of the code"):
        LightningLite(accelerator="cpu", devices=3)


def test_legacy_gpus_argument_decides_accelerator_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_DEVICES", "2")
    monkeypatch.setenv("LITE_ACCELERATOR", "cpu")
    # gpus=1 means accelerator="cuda", devices=1: the variables do not turn it into a conflict.
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigurationError) as info:
        LightningLite(gpus=1)
    assert "cannot be combined" not in str(info.value)


def test_subclass_keeps_the_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    class Job(LightningLite):
        def __init__(self, tag: str) -> None:
            super().__init__(accelerator="cpu")
            self.tag = tag

    monkeypatch.setenv("LITE_DEVICES", "2")
    job = Job("x")
    assert job.strategy.name == "ddp" and job.strategy.device_indexes == [0, 1]


def test_legacy_deprecation_warning_points_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning) as record, pytest.raises(ConfigurationError):
        LightningLite(tpu_cores=8)
    assert record[0].filename == __file__


def test_the_constructor_signature_names_real_types() -> None:
    """The API reference (griffe, reading the source) shows these annotations: none may be `Any`."""
    import inspect

    from lite_core import LightningLite

    parameters = list(inspect.signature(LightningLite.__init__).parameters.values())[1:]
    assert [p.name for p in parameters][:5] == ["accelerator", "strategy", "devices", "num_nodes", "precision"]
    assert {p.name: str(p.annotation) for p in parameters if "Any" in str(p.annotation)} == {}
    annotations = {p.name: str(p.annotation) for p in parameters}
    assert annotations["accelerator"] == "str | Accelerator" and annotations["strategy"] == "str | Strategy"
