"""The `tpu`/`xla` accelerator: registration, device parsing, availability, resolution."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import run_fresh  # the repository's conftest.py
from lite_core import LightningLite
from lite_core._registry import ACCELERATORS, STRATEGIES
from lite_core.errors import ConfigurationError
from lite_xla.accelerator import XLAAccelerator


def test_tpu_and_xla_name_the_same_accelerator_class() -> None:
    assert ACCELERATORS.load("tpu") is XLAAccelerator
    assert ACCELERATORS.load("xla") is XLAAccelerator
    assert {"single_xla", "xla", "xla_fsdp"} <= set(STRATEGIES.names())


@pytest.mark.parametrize(("devices", "indexes"), [
    (1, [0]), (8, list(range(8))), ("8", list(range(8))), ([5], [5]), ((2,), [2]),
])
def test_devices_parse_to_indexes(devices: Any, indexes: list[int]) -> None:
    assert XLAAccelerator.parse_devices(devices) == indexes


def test_auto_devices_count_the_cpu_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    assert XLAAccelerator.parse_devices("auto") == [0]
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    assert XLAAccelerator.parse_devices("auto") == [0, 1, 2]


@pytest.mark.parametrize("devices", [0, -1, [0, 1], [], True, "two", 1.5])
def test_invalid_devices_fail_in_one_sentence(devices: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"devices=1, devices=\[index\] or devices=N"):
        XLAAccelerator.parse_devices(devices)


def test_available_only_with_a_tpu_or_a_pjrt_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert XLAAccelerator.is_available()
    monkeypatch.delenv("PJRT_DEVICE")
    assert not XLAAccelerator.is_available()  # this machine has no TPU


def test_auto_prefers_xla_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert LightningLite(devices=1).strategy.accelerator.name == "tpu"
    monkeypatch.delenv("PJRT_DEVICE")
    assert LightningLite(devices=1).strategy.accelerator.name == "cpu"


@pytest.mark.parametrize(("accelerator", "devices", "strategy"), [
    ("tpu", 1, "single_xla"), ("xla", [3], "single_xla"), ("tpu", 2, "xla"), ("tpu", 8, "xla"),
])
def test_auto_strategy_for_xla(accelerator: str, devices: Any, strategy: str) -> None:
    lite = LightningLite(accelerator=accelerator, devices=devices)
    assert lite.strategy.name == strategy
    assert lite.strategy.device_indexes == XLAAccelerator.parse_devices(devices)


def test_xla_strategies_refuse_other_accelerators() -> None:
    with pytest.raises(ConfigurationError, match=r"does not run on accelerator='cpu'.*\['tpu'\]"):
        LightningLite(accelerator="cpu", strategy="xla", devices=2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_cores_process_group_strategies_refuse_xla_devices(strategy: str) -> None:
    # XLA declares no torch.distributed backend; the core's strategies ask for one, naming no device.
    with pytest.raises(ConfigurationError, match=rf"^strategy='{strategy}' does not run on accelerator='tpu': it"
                                                 " needs a torch.distributed process group"):
        LightningLite(accelerator="tpu", strategy=strategy, devices=2)


@pytest.mark.parametrize("precision", ["16-mixed", "64-true", "16-true"])
def test_unsupported_precision_names_the_supported_ones(precision: str) -> None:
    with pytest.raises(ConfigurationError, match=r"\['32-true', 'bf16-mixed', 'bf16-true'\]"):
        LightningLite(accelerator="tpu", devices=1, precision=precision)


def test_cpu_replica_count_must_agree_with_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    with pytest.raises(ConfigurationError, match="CPU_NUM_DEVICES=4 is set: unset CPU_NUM_DEVICES or pass devices=4"):
        LightningLite(accelerator="tpu", devices=2)


def test_neither_import_nor_construction_starts_the_xla_runtime() -> None:
    code = (
        "import sys\n"
        "import lite_xla.accelerator, lite_xla\n"
        "assert 'torch_xla' not in sys.modules, 'importing lite_xla imported torch_xla'\n"
        "from lite_core import LightningLite\n"
        "lite = LightningLite(accelerator='tpu', devices=2)\n"
        "assert lite.world_size == 2 and lite.global_rank == 0\n"
        "assert 'torch_xla' not in sys.modules, 'construction imported torch_xla'\n"
        "print('ok')\n"
    )
    proc = run_fresh(code)  # not forked from the test session's server: it preloads torch_xla
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.fixture
def tpu_host_with_4_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr("lite_xla.accelerator._tpu_device_count", lambda: 4)


@pytest.mark.usefixtures("tpu_host_with_4_devices")
@pytest.mark.parametrize(("devices", "indexes"), [(1, [0]), (4, [0, 1, 2, 3]), ("auto", [0, 1, 2, 3]), ([3], [3])])
def test_devices_the_tpu_host_has_are_accepted(devices: Any, indexes: list[int]) -> None:
    assert XLAAccelerator.parse_devices(devices) == indexes


@pytest.mark.usefixtures("tpu_host_with_4_devices")
@pytest.mark.parametrize(("devices", "message"), [
    (8, r"^devices=8 asks for 8 TPU devices but this host has 4, .* pass devices=4 \(or devices=1\)\.$"),
    (2, r"^devices=2 asks for 2 TPU devices but this host has 4, .* pass devices=4 \(or devices=1\)\.$"),
    ([4], r"^devices=\[4\] names TPU device 4 but this host has 4 \(0 to 3\): pass devices=\[index\] with an"),
])
def test_devices_the_tpu_host_lacks_are_refused_at_construction(devices: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        LightningLite(accelerator="tpu", devices=devices)


def test_tpu_devices_are_counted_from_the_pci_ids_of_the_chips(tmp_path: Any) -> None:
    from lite_xla.accelerator import _tpu_device_count

    chips = {"a": ("0x1ae0", "0x0027"), "b": ("0x1ae0", "0x0027"), "c": ("0x1ae0", "0x005e"), "d": ("0x8086", "0x0027")}
    for name, (vendor, device) in chips.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    assert _tpu_device_count(str(tmp_path)) == 2 + 2 + 1  # v2/v3 chips hold two cores; not Google's: none
