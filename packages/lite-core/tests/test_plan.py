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


# -- the precision is the plan's, handed to the strategy's hooks, never held by the strategy ------------------------
def _connected(name: str) -> LightningLite:
    """A `LightningLite` connected with the registered strategy `name` (skipped where its backend
    cannot be imported or constructed here, e.g. fairscale's `ddp_sharded` outside test-fairscale)."""
    from lite_core._registry import STRATEGIES

    try:
        STRATEGIES.load(name)
    except ImportError as err:
        pytest.skip(f"strategy={name!r} cannot be imported here: {err}")
    accelerator = "fake" if name.startswith("fake") else "cpu"
    devices = 1 if name in ("single_device", "fake_single") else 2
    try:
        return LightningLite(accelerator=accelerator, strategy=name, devices=devices, precision="bf16-mixed")
    except ConfigurationError as err:
        pytest.skip(f"strategy={name!r} cannot be constructed here: {err}")


def _registered() -> list[str]:
    from lite_core._registry import STRATEGIES

    return sorted(STRATEGIES.names())


@pytest.mark.parametrize("name", _registered())
def test_no_connected_strategy_holds_a_precision(name: str) -> None:
    lite = _connected(name)
    assert lite._plan.precision.name == "bf16-mixed"
    assert not hasattr(lite._plan.strategy, "precision")  # the plan's, handed to each hook that needs it


def test_every_room_hands_the_plans_precision_to_the_strategy(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Recording(SingleDeviceStrategy):
        def module_init_context(self, empty_init: bool | None = None, *, precision: Any) -> Any:
            seen["module_init_context"] = precision
            return super().module_init_context(empty_init, precision=precision)

        def setup_module(self, module: nn.Module, *, precision: Any) -> nn.Module:
            seen["setup_module"] = precision
            return super().setup_module(module, precision=precision)

        def backward(self, tensor: torch.Tensor, module: Any, *args: Any, precision: Any, **kwargs: Any) -> None:
            seen["backward"] = precision
            super().backward(tensor, module, *args, precision=precision, **kwargs)

        def optimizer_step(self, optimizer: Any, *, precision: Any, **kwargs: Any) -> Any:
            seen["optimizer_step"] = precision
            return super().optimizer_step(optimizer, precision=precision, **kwargs)

        def clip_gradients_norm(self, *args: Any, precision: Any) -> Any:
            seen["clip_gradients_norm"] = precision
            return super().clip_gradients_norm(*args, precision=precision)

        def clip_gradients_value(self, *args: Any, precision: Any) -> None:
            seen["clip_gradients_value"] = precision
            super().clip_gradients_value(*args, precision=precision)

        def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: Any, precision: Any) -> None:
            seen["save_checkpoint"] = precision
            super().save_checkpoint(path, content, checkpoint_io=checkpoint_io, precision=precision)

        def load_checkpoint(self, path: str, state: Any = None, strict: bool = True, weights_only: bool = True, *,
                            checkpoint_io: Any, precision: Any) -> dict[str, Any]:
            seen["load_checkpoint"] = precision
            return super().load_checkpoint(path, state, strict, weights_only, checkpoint_io=checkpoint_io,
                                           precision=precision)

    lite = LightningLite(accelerator="cpu", strategy=Recording(), precision="bf16-mixed")
    with lite.init_module():
        layer = nn.Linear(2, 2)
    model, optimizer = lite.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    lite.backward(model(torch.ones(1, 2)).float().sum())
    lite.clip_gradients(model, optimizer, max_norm=1.0)
    lite.clip_gradients(model, optimizer, clip_val=1.0)
    optimizer.step()
    lite.save({"model": model}, tmp_path / "c.pt")
    lite.load(tmp_path / "c.pt", {"model": model})
    assert sorted(seen) == sorted(["module_init_context", "setup_module", "backward", "optimizer_step",
                                   "clip_gradients_norm", "clip_gradients_value", "save_checkpoint",
                                   "load_checkpoint"])
    assert all(precision is lite._plan.precision for precision in seen.values())


class _OldClipping(SingleDeviceStrategy):
    """A strategy written before the precision left the strategy: its override lacks the keyword."""

    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> Any:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


class _OldStep(SingleDeviceStrategy):
    """Its own step, calling the precision it expects to hold."""

    steps_optimizers_plainly = False

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self.precision.optimizer_step(optimizer, **kwargs)  # type: ignore[attr-defined]


class _OldSetup(SingleDeviceStrategy):
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        return module


def test_a_strategy_override_without_the_precision_keyword_fails_loudly() -> None:
    lite = LightningLite(accelerator="cpu", strategy=_OldClipping())
    layer = nn.Linear(2, 2)
    model, optimizer = lite.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    lite.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(TypeError, match="precision"):
        lite.clip_gradients(model, optimizer, max_norm=1.0)

    lite = LightningLite(accelerator="cpu", strategy=_OldStep())
    layer = nn.Linear(2, 2)
    model, optimizer = lite.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    lite.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(AttributeError, match="precision"):
        optimizer.step()

    with pytest.raises(TypeError, match="precision"):
        LightningLite(accelerator="cpu", strategy=_OldSetup()).setup_module(nn.Linear(2, 2))


def test_the_plan_holds_the_model_parallel_mesh_layout_resolved_and_none_for_other_strategies() -> None:
    from lite_core.parallel import MeshLayout
    from lite_core.strategies.model_parallel import ModelParallelStrategy

    plan = LightningLite(accelerator="cpu", devices=4,
                         strategy=ModelParallelStrategy(lambda model, mesh: model, mesh=MeshLayout(shard=2)))._plan
    assert plan.mesh_layout is plan.strategy.mesh_layout
    assert plan.mesh_layout.sizes() == MeshLayout(shard=2, tensor=2).sizes()  # "auto" resolved against 4 processes
    assert LightningLite(accelerator="cpu", strategy="ddp", devices=2)._plan.mesh_layout is None
