"""Adapters-only checkpoints on one process: `trainable_state(model)` saves the parameters that
train and nothing else, loads them back without touching the frozen ones, and refuses a
checkpoint whose weights do not fit. Under `ddp` and `fsdp`, with peft's LoRA against plain peft:
tests/integration/test_fine_tuning.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import CheckpointError


def _model(seed: int, trains: str = "adapter") -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("base", nn.Linear(4, 4))
    model.add_module("adapter", nn.Linear(4, 4))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(trains))
    return model


def _set_up(lite: LightningLite, seed: int, trains: str = "adapter") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed, trains)
    return lite.setup(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1))


def test_only_the_trainable_parameters_are_saved_and_loaded_with_their_optimizer_state(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu", devices=1)
    model, optimizer = _set_up(lite, seed=0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    lite.save({"adapters": lite.trainable_state(model), "optimizer": optimizer}, tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt", weights_only=True)
    assert sorted(saved["adapters"]) == ["adapter.bias", "adapter.weight"]
    assert sorted(lite.full_state_dict(model, trainable_only=True)) == ["adapter.bias", "adapter.weight"]

    other, other_optimizer = _set_up(lite, seed=1)
    frozen = {name: value.clone() for name, value in other.state_dict().items() if name.startswith("base")}
    lite.load(tmp_path / "ckpt", {"adapters": lite.trainable_state(other), "optimizer": other_optimizer})
    for name in ("adapter.weight", "adapter.bias"):
        assert torch.equal(other.state_dict()[name], model.state_dict()[name]), name
    for name, value in frozen.items():
        assert torch.equal(other.state_dict()[name], value), f"{name} was touched"
    assert other_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    assert torch.equal(other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_checkpoint_of_other_trainable_parameters_is_refused_naming_them(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu", devices=1)
    model, _ = _set_up(lite, seed=0)
    lite.save({"adapters": lite.trainable_state(model)}, tmp_path / "ckpt")
    other, _ = _set_up(lite, seed=1, trains="base")
    with pytest.raises(CheckpointError, match=r"2 missing from the checkpoint.*'base\.weight'.*2 unexpected") as info:
        lite.load(tmp_path / "ckpt", {"adapters": lite.trainable_state(other)})
    assert ". " not in str(info.value)
