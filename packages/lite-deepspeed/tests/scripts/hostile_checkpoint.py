"""A DeepSpeed checkpoint from a shared bucket whose files call `os.system` when unpickled.

    python hostile_checkpoint.py FOLDER

Saves under ZeRO-2 (one process), plants the call into the model-states file, then loads it as a
user would: under `deepspeed` (DeepSpeed's own reader) and under `single_device` (Lite's whole
reader). Both must refuse it without running it; `weights_only=False` runs it (the payload is real).
Prints one `OK <check>` line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from lite_core import LightningLite
from lite_core.errors import CheckpointError
from lite_deepspeed import DeepSpeedStrategy


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch '{self.marker}'",)


def model_and_optimizer(lite: LightningLite) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    return lite.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def save(lite: LightningLite, path: str) -> None:
    model, optimizer = model_and_optimizer(lite)
    lite.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    lite.save({"model": model, "optimizer": optimizer, "step": 1}, path)


def plant(path: str, marker: Path) -> None:
    (states,) = Path(path).glob("*/*model_states.pt")
    content = torch.load(states, map_location="cpu", weights_only=False)
    torch.save({**content, "note": RunsACommand(marker)}, states)


def refused(check: str, load, marker: Path) -> None:
    try:
        load()
    except CheckpointError as err:
        assert "call load(..., weights_only=False)" in str(err), err
    else:
        raise AssertionError(f"{check}: the checkpoint loaded")
    assert not marker.exists(), f"{check}: the checkpoint's command ran"
    print(f"OK {check}")


def under_deepspeed(lite: LightningLite, path: str, marker: Path) -> None:
    model, optimizer = model_and_optimizer(lite)
    refused("refused under deepspeed", lambda: lite.load(path, {"model": model, "optimizer": optimizer}), marker)


def under_single_device(lite: LightningLite, path: str, marker: Path) -> None:
    model, optimizer = model_and_optimizer(lite)
    refused("refused under single_device", lambda: lite.load(path, {"model": model, "optimizer": optimizer}), marker)
    refused("refused by load(path)", lambda: lite.load(path), marker)
    lite.load(path, {"model": model, "optimizer": optimizer}, strict=False, weights_only=False)
    assert marker.exists(), "weights_only=False did not run the payload: the check proves nothing"
    print("OK weights_only=False reads it as DeepSpeed does")


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    path, marker = str(folder / "ckpt"), folder / "ran"
    LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=1).launch(save, path)
    plant(path, marker)
    LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=1).launch(under_deepspeed, path,
                                                                                             marker)
    LightningLite(accelerator="cpu").launch(under_single_device, path, marker)
