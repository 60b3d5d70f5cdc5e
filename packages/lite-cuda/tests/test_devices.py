"""How `devices` becomes GPU indexes, and the one-sentence errors for what cannot be."""

from __future__ import annotations

from typing import Any

import pytest

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_cuda._devices import parse_devices


@pytest.mark.parametrize(
    ("devices", "visible", "indexes"),
    [
        ("auto", 4, [0]),
        (None, 4, [0]),
        (1, 4, [0]),
        (2, 4, [0, 1]),
        ("2", 4, [0, 1]),
        (" 3 ", 4, [0, 1, 2]),
        (-1, 4, [0, 1, 2, 3]),
        ("-1", 3, [0, 1, 2]),
        ([0, 2], 4, [0, 2]),
        ((3, 1), 4, [3, 1]),
        ("0,1", 4, [0, 1]),
        ("1, 3", 4, [1, 3]),
        ("2,", 4, [2]),
    ],
)
def test_devices_become_visible_gpu_indexes(devices: Any, visible: int, indexes: list[int]) -> None:
    assert parse_devices(devices, visible) == indexes


def one_sentence(match: str, devices: Any, visible: int) -> str:
    with pytest.raises(ConfigurationError, match=match) as info:
        parse_devices(devices, visible)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    return message


@pytest.mark.parametrize(
    ("devices", "visible", "match"),
    [
        (4, 2, r"^devices=4 asks for 4 GPUs but only 2 are visible: pass devices=2 or fewer"),
        ("3", 1, r"^devices='3' asks for 3 GPUs but only 1 is visible: pass devices=1 or fewer"),
        ([0, 2], 2, r"^devices=\[0, 2\] names GPU 2 but the visible GPUs are \[0, 1\]: pass indexes from that list\.$"),
        ("0,5", 4, r"^devices='0,5' names GPU 5 but the visible GPUs are \[0, 1, 2, 3\]"),
        ([1, 1], 2, r"^devices=\[1, 1\] names GPU 1 twice: list each GPU once\.$"),
    ],
)
def test_asking_for_gpus_that_do_not_exist_names_what_does(devices: Any, visible: int, match: str) -> None:
    one_sentence(match, devices, visible)


@pytest.mark.parametrize("devices", [0, -2, "0", True, [], [-1], [0.5], "x", "0,a", 1.5, {0: 1}, "gpu"])
def test_malformed_devices_list_every_accepted_form(devices: Any) -> None:
    message = one_sentence(r"is not valid for accelerator='cuda'", devices, 4)
    assert "-1 for every visible GPU" in message and "'0,2'" in message


def test_errors_count_within_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    message = one_sentence(r"only 2 are visible \(counted within CUDA_VISIBLE_DEVICES='1,3'\)", 3, 2)
    assert "devices=2 or fewer" in message
    one_sentence(r"visible GPUs are \[0, 1\] \(counted within CUDA_VISIBLE_DEVICES='1,3'\)", [3], 2)


# --- through LightningLite, on a faked runtime ---------------------------------------------------------

def test_lite_parses_devices_against_the_gpus_the_runtime_reports(fake_gpus: Any) -> None:
    fake_gpus(3)
    lite = LightningLite(accelerator="cuda", strategy="ddp_spawn", devices="0,2")
    assert lite.strategy.device_indexes == [0, 2]

    fake_gpus(1)
    with pytest.raises(ConfigurationError, match=r"devices=2 asks for 2 GPUs but only 1 is visible"):
        LightningLite(accelerator="cuda", devices=2)


def test_minus_one_takes_every_gpu_and_auto_takes_one(fake_gpus: Any) -> None:
    fake_gpus(4)
    assert LightningLite(accelerator="cuda", devices=-1).strategy.device_indexes == [0, 1, 2, 3]
    lite = LightningLite(accelerator="cuda")
    assert lite.strategy.device_indexes == [0]
    assert lite.strategy.name == "single_device"
