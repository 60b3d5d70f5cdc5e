"""Tests of how `LightningLite(...)` resolves accelerator, strategy, devices, precision and plugins.

Every test only constructs `LightningLite`, which launches nothing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lite_core import _registry
from lite_core.accelerators.cpu import CPUAccelerator
from lite_core.environments import LocalEnvironment
from lite_core.errors import BackendNotInstalledError, ConfigurationError
from lite_core.checkpoint import CheckpointIO
from lite_core.lite import LightningLite
from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision
from lite_core.strategies.ddp import DDPStrategy
from lite_core.strategies.single_device import SingleDeviceStrategy

# A plain local process: no launcher variables of the host (the fixture is the repository's conftest.py).
pytestmark = pytest.mark.usefixtures("clean_env")


def config_error(match: str, **kwargs: Any) -> str:
    """Construct `LightningLite(**kwargs)`, expect a one-sentence `ConfigurationError`, return it."""
    with pytest.raises(ConfigurationError, match=match) as info:
        LightningLite(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith(".")
    return message


# --- configuration errors ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accelerator": "cpu", "devices": 0}, r"devices=0 is not valid"),
        ({"accelerator": "cpu", "devices": -3}, r"devices=-3 is not valid"),
        ({"accelerator": "cpu", "devices": "x"}, r"devices='x' is not valid"),
        ({"num_nodes": 0}, r"num_nodes=0 is not valid"),
        ({"num_nodes": "2"}, r"num_nodes='2' is not valid"),
        ({"precision": "17"}, r"precision='17' is not supported: choose one of \["),
        ({"precision": True}, r"precision=True is not supported"),
        ({"strategy": 123}, r"strategy=123 is neither a name nor a Strategy"),
        ({"accelerator": 3.5}, r"accelerator=3.5 is neither a name nor an Accelerator"),
        ({"plugins": [object()]}, r"plugins got <object object .*>, which is not a Precision"),
        ({"plugins": [Precision(), Precision()]}, r"plugins holds two Precision objects"),
        ({"precision": Precision(), "plugins": Precision()}, r"plugins holds two Precision objects"),
        ({"strategy": "single_device", "devices": 2}, r"strategy='single_device' runs one process"),
        ({"accelerator": "fake"}, r"accelerator='fake' was requested but this machine has no such device"),
    ],
)
def test_bad_configuration_fails_at_construction_in_one_sentence(kwargs: dict[str, Any], match: str) -> None:
    config_error(match, **kwargs)


def test_multi_node_needs_the_main_address_without_a_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(r"num_nodes=2 without a cluster scheduler", accelerator="cpu", num_nodes=2)
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        assert name in message

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NODE_RANK", "1")
    lite = LightningLite(accelerator="cpu", num_nodes=2)
    assert lite.strategy.name == "ddp"
    assert lite.strategy.num_nodes == 2


@pytest.mark.parametrize(("flag", "extra"), [("gpus", "cuda"), ("tpu_cores", "xla")])
def test_legacy_device_flags_warn_and_need_their_backend(flag: str, extra: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"{flag}= is deprecated"):
        with pytest.raises(BackendNotInstalledError, match=rf"pip install '\./packages/lite-core\[{extra}\]' \./packages/lite-") as info:
            LightningLite(**{flag: 8 if flag == "tpu_cores" else 2})
    assert "\n" not in str(info.value)


def test_legacy_gpus_with_another_accelerator_is_refused() -> None:
    config_error(r"gpus=2 cannot be combined with accelerator/devices.*accelerator='cuda', devices=2",
                 gpus=2, accelerator="cpu")
    config_error(r"tpu_cores=8 cannot be combined", tpu_cores=8, devices=2)


# --- accelerator priority and what each class declares ---------------------------------------------

def test_auto_accelerator_picks_the_highest_priority_available(monkeypatch: pytest.MonkeyPatch) -> None:
    lite = LightningLite()
    assert lite.strategy.accelerator is not None
    assert lite.strategy.accelerator.name == "cpu"

    monkeypatch.setenv("LITE_FAKE_AVAILABLE", "1")
    lite = LightningLite()
    assert lite.strategy.accelerator is not None
    assert lite.strategy.accelerator.name == "fake"
    assert lite.strategy.name == "single_device"
    assert lite.device == torch.device("cpu")


def test_strategy_on_an_unsupported_accelerator_names_the_supported_ones() -> None:
    config_error(r"strategy='fake_single' does not run on accelerator='cpu': choose one of \['fake'\]",
                 strategy="fake_single", accelerator="cpu")


def test_auto_accelerator_follows_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    config_error(r"No available accelerator supports the chosen strategy \(it runs on \['fake'\]\)",
                 strategy="fake_single")

    monkeypatch.setenv("LITE_FAKE_AVAILABLE", "1")
    lite = LightningLite(strategy="fake_single")
    assert lite.strategy.name == "fake_single"
    assert lite.strategy.accelerator is not None
    assert lite.strategy.accelerator.name == "fake"


def test_precision_unsupported_by_the_accelerator_names_the_supported_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_FAKE_AVAILABLE", "1")
    config_error(r"precision='16-mixed' is not supported by .* accelerator='fake': choose one of"
                 r" \['32-true', 'bf16-true'\]", accelerator="fake", precision="16-mixed")

    lite = LightningLite(accelerator="fake", precision="bf16-true")
    assert lite._plan.precision.name == "bf16-true"


# --- precision names ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("given", "name"),
    [(64, "64-true"), (32, "32-true"), (16, "16-mixed"), ("bf16", "bf16-mixed"), ("16", "16-mixed"),
     ("32", "32-true"), ("64", "64-true")],
)
def test_legacy_precision_values_work_with_a_warning_that_names_the_new_value(given: Any, name: str) -> None:
    with pytest.warns(FutureWarning, match=rf"^precision={given!r} is deprecated: pass precision='{name}' instead\.$") \
            as caught:
        lite = LightningLite(accelerator="cpu", precision=given)
    assert lite._plan.precision.name == name
    assert caught[0].filename == __file__  # attributed to the line that constructed LightningLite


def test_current_precision_names_give_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    for name in ("bf16-true", "32-true", "64-true"):
        assert LightningLite(accelerator="cpu", precision=name)._plan.precision.name == name
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize(("given", "guess"), [("fp16", "16-mixed"), ("bfloat16", "bf16-mixed"), ("FP32", "32-true"),
                                              ("16-mixd", "16-mixed"), ("double", "64-true")])
def test_a_misspelt_precision_gets_a_guess(given: str, guess: str) -> None:
    config_error(rf"^precision='{given}' is not supported: did you mean '{guess}'\? choose one of \[", precision=given)


def test_accelerator_and_strategy_names_are_case_insensitive(monkeypatch: pytest.MonkeyPatch,
                                                             recwarn: pytest.WarningsRecorder) -> None:
    lite = LightningLite(accelerator="CPU", strategy="DDP", devices=2)
    assert (lite.strategy.name, lite.strategy.accelerator.name) == ("ddp", "cpu")
    monkeypatch.setenv("LITE_ACCELERATOR", "Cpu")
    monkeypatch.setenv("LITE_STRATEGY", "DDP")
    lite = LightningLite(strategy="ddp", devices=2)  # the same name as the variable's: no "ignored" warning
    assert (lite.strategy.name, lite.strategy.accelerator.name) == ("ddp", "cpu")
    assert not [str(w.message) for w in recwarn if "is ignored" in str(w.message)]


# --- instances are used as given -------------------------------------------------------------------

class _DictCheckpointIO(CheckpointIO):
    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        self.saved[str(path)] = checkpoint

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        return self.saved[str(path)]


def test_instances_are_used_as_given() -> None:
    strategy = SingleDeviceStrategy()
    accelerator = CPUAccelerator()
    precision = TruePrecision("64-true", torch.float64)
    environment = LocalEnvironment()
    checkpoint_io = _DictCheckpointIO()

    lite = LightningLite(accelerator=accelerator, strategy=strategy, precision=precision,
                         plugins=[environment, checkpoint_io])

    assert lite.strategy is strategy
    assert strategy.accelerator is accelerator
    assert lite._plan.precision is precision
    assert strategy.environment is environment
    assert lite._plan.checkpoint_io is checkpoint_io  # the checkpoint room's, handed to each save and load


def test_plugins_may_be_a_single_object_and_precision_a_plugin() -> None:
    precision = TruePrecision("64-true", torch.float64)
    checkpoint_io = _DictCheckpointIO()

    lite = LightningLite(accelerator="cpu", plugins=precision)
    assert lite._plan.precision is precision
    lite = LightningLite(accelerator="cpu", plugins=(checkpoint_io,))
    assert lite._plan.checkpoint_io is checkpoint_io


def test_distributed_strategy_instance_is_used_as_given() -> None:
    strategy = DDPStrategy(timeout=5)

    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=2)

    assert lite.strategy is strategy
    assert strategy.device_indexes == [0, 1]
    assert strategy.timeout.total_seconds() == 5


# --- strategy="auto" -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("devices", "name"), [(1, "single_device"), ("auto", "single_device"), (2, "ddp")])
def test_auto_strategy_follows_the_device_count(devices: Any, name: str) -> None:
    lite = LightningLite(accelerator="cpu", devices=devices)
    assert lite.strategy.name == name


class _SpawningCPU(CPUAccelerator):
    default_distributed_strategy = "ddp_spawn"


def test_auto_strategy_reads_the_accelerators_default() -> None:
    lite = LightningLite(accelerator=_SpawningCPU(), devices=2)
    assert lite.strategy.name == "ddp_spawn"
    lite = LightningLite(accelerator=_SpawningCPU(), devices=1)
    assert lite.strategy.name == "single_device"


# --- hooks a backend declares or overrides ---------------------------------------------------------

class _OneProcessManyDevices(SingleDeviceStrategy):
    name = "one_process_many_devices"
    drives_devices_from_one_process = True


def test_a_strategy_that_drives_several_devices_from_one_process_accepts_them() -> None:
    lite = LightningLite(accelerator="cpu", strategy=_OneProcessManyDevices(), devices=3)

    assert lite.strategy.device_indexes == [0, 1, 2]
    assert lite.world_size == 1
    assert lite.strategy.launcher is None


def test_a_one_process_strategy_still_refuses_several_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0")):
        monkeypatch.setenv(name, value)
    config_error(r"strategy='one_process_many_devices' runs one process but devices=2, num_nodes=2",
                 accelerator="cpu", strategy=_OneProcessManyDevices(), devices=2, num_nodes=2)


class _PickyCPU(CPUAccelerator):
    def __init__(self) -> None:
        self.validated: list[tuple[str, list[int]]] = []

    def validate_precision(self, precision: str, device_indexes: list[int]) -> None:
        self.validated.append((precision, device_indexes))
        if precision == "bf16-mixed":
            raise ConfigurationError("precision='bf16-mixed' is not supported by this device: use '16-mixed'.")


def test_the_accelerator_validates_the_resolved_precision_at_construction() -> None:
    accelerator = _PickyCPU()
    LightningLite(accelerator=accelerator, precision=16, devices=2)
    assert accelerator.validated == [("16-mixed", [0, 1])]

    config_error(r"precision='bf16-mixed' is not supported by this device", accelerator=_PickyCPU(),
                 precision="bf16")
    config_error(r"precision='bf16-mixed' is not supported by this device", accelerator=_PickyCPU(),
                 plugins=MixedPrecision("bf16-mixed", "cpu"))


def test_an_unavailable_accelerator_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _registry.ACCELERATORS.load("fake")
    monkeypatch.setattr(fake, "unavailable_reason", classmethod(lambda cls: "LITE_FAKE_AVAILABLE is not 1"))

    config_error(r"^accelerator='fake' was requested but LITE_FAKE_AVAILABLE is not 1: use accelerator='auto'"
                 r" or 'cpu'\.$", accelerator="fake")


class _OwnSingleDeviceCPU(CPUAccelerator):
    default_single_device_strategy = "ddp_spawn"  # any registered name: the connector must read it


def test_auto_strategy_reads_the_accelerators_single_device_default() -> None:
    lite = LightningLite(accelerator=_OwnSingleDeviceCPU(), devices=1)
    assert lite.strategy.name == "ddp_spawn"
    lite = LightningLite(accelerator=_OwnSingleDeviceCPU(), devices=2)
    assert lite.strategy.name == "ddp"
