"""The job's plan: one frozen record built by the connector, whose parts the rooms receive."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.accelerators.cpu import CPUAccelerator
from lite_core.checkpoint import TorchCheckpointIO
from lite_core.connector._plan import Plan
from lite_core.errors import ConfigurationError
from lite_core.model._module import STATE_KEY
from lite_core.strategies.single_device import SingleDeviceStrategy


def test_the_plan_is_frozen() -> None:
    plan = LightningLite(accelerator="cpu")._plan
    assert isinstance(plan, Plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.precision = plan.precision  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.strategy = plan.strategy  # type: ignore[misc]


def test_the_plan_holds_what_the_connector_resolved() -> None:
    checkpoint_io = TorchCheckpointIO()
    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2, precision="bf16-mixed", plugins=checkpoint_io)
    plan = lite._plan
    assert plan.strategy is lite.strategy
    assert plan.accelerator.name == "cpu" and plan.precision.name == "bf16-mixed"
    assert plan.checkpoint_io is checkpoint_io
    assert plan.device_indexes == (0, 1) and plan.num_nodes == 1
    assert plan.launcher is not None  # ddp re-runs the script for the second rank


def test_one_process_has_no_launcher() -> None:
    assert LightningLite(accelerator="cpu")._plan.launcher is None


def test_the_rooms_receive_the_plans_parts() -> None:
    lite = LightningLite(accelerator="cpu", precision="bf16-mixed")
    plan = lite._plan
    assert lite._models._precision is plan.precision
    assert lite._models._strategy is plan.strategy
    assert lite._running._launcher is plan.launcher
    assert lite._checkpoints._strategy is lite._collectives._strategy is lite._loaders._strategy is plan.strategy
    layer = nn.Linear(2, 2)
    model, _ = lite.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    assert model.__dict__[STATE_KEY].precision is plan.precision


def test_a_copy_sent_to_a_worker_leaves_the_launcher_behind() -> None:
    plan = LightningLite(accelerator="cpu", strategy="ddp", devices=2)._plan
    copy = pickle.loads(pickle.dumps(plan))
    assert copy.launcher is None and copy.device_indexes == plan.device_indexes


def test_a_strategy_that_drops_its_parts_is_refused() -> None:
    class Forgetful(SingleDeviceStrategy):
        def connect(self, accelerator, environment, device_indexes, num_nodes):  # type: ignore[no-untyped-def]
            super().connect(CPUAccelerator(), environment, device_indexes, num_nodes)  # not the one given

    with pytest.raises(ConfigurationError, match="Forgetful does not hold the accelerator"):
        LightningLite(accelerator="cpu", strategy=Forgetful())


class _RecordingCheckpointIO(TorchCheckpointIO):
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        self.saved.append(str(path))
        super().save(checkpoint, path)


@pytest.mark.parametrize("strategy", ["single_device", "fsdp"])
def test_the_checkpoint_room_holds_the_checkpoint_io_and_hands_it_to_the_strategy(tmp_path: Path,
                                                                                   strategy: str) -> None:
    checkpoint_io = _RecordingCheckpointIO()
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=1, plugins=checkpoint_io)
    assert not hasattr(lite.strategy, "checkpoint_io")
    assert lite._checkpoints._checkpoint_io is lite._plan.checkpoint_io is checkpoint_io

    def save_and_load(lite: LightningLite) -> Any:
        lite.save({"step": 3}, tmp_path / "step.pt")
        return lite.load(tmp_path / "step.pt")["step"]

    assert lite.launch(save_and_load) == 3
    assert checkpoint_io.saved  # the file, or a sharded checkpoint's file of the values besides the shards
