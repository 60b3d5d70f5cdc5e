"""A DeepSpeed checkpoint loaded into a model built differently, as a user edits a model between runs.

    python mismatch.py FOLDER

Saves `Linear(4, 6) -> Linear(6, 1)` under ZeRO-2 (one process), then loads it into
`Linear(4, 3) -> Linear(3, 1)` (other shapes) and into `Linear(6, 4) -> ...` (the same numbers of
elements, transposed): under ZeRO-2 (DeepSpeed's own reader) and under ZeRO-3 (Lite's whole reader,
which copies a weight of the same size without complaint unless the shapes are checked). Each load
must be refused with the one sentence naming the weights of another shape. The save precedes the
optimizer's first step (no moments yet), which the whole reader reads too. Prints `OK <check>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lite_core import LightningLite
from lite_core.errors import CheckpointError
from lite_deepspeed import DeepSpeedStrategy


def setup(lite: LightningLite, first: tuple[int, int]) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(*first, bias=False), torch.nn.Linear(first[1], 1, bias=False))
    return lite.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def save(lite: LightningLite, path: str) -> None:
    model, optimizer = setup(lite, (4, 6))
    lite.save({"model": model, "optimizer": optimizer}, path)


def refused(lite: LightningLite, path: str, check: str) -> None:
    for first in ((4, 3), (6, 4)):
        model, optimizer = setup(lite, first)
        try:
            lite.load(path, {"model": model, "optimizer": optimizer})
        except CheckpointError as err:
            assert "another shape in the checkpoint" in str(err) and "'0.weight': (6, 4) saved" in str(err), err
        else:
            raise AssertionError(f"{check}: a checkpoint of Linear(4, 6) loaded into Linear{first}")
    print(f"OK {check}")


def loads_before_the_first_step(lite: LightningLite, path: str) -> None:
    model, optimizer = setup(lite, (4, 6))
    lite.load(path, {"model": model, "optimizer": optimizer})
    lite.backward(model(torch.randn(2, 4)).sum(), model=model)  # the refused loads set up two models before
    optimizer.step()
    print("OK a save before the first step loads under another layout")


def under_zero_3(lite: LightningLite, path: str) -> None:
    refused(lite, path, "refused by the whole reader")
    loads_before_the_first_step(lite, path)


if __name__ == "__main__":
    path = str(Path(sys.argv[1]) / "ckpt")
    LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=1).launch(save, path)
    LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=1).launch(
        refused, path, "refused by deepspeed's reader")
    LightningLite(accelerator="cpu", strategy=DeepSpeedStrategy(stage=3), devices=1).launch(under_zero_3, path)
