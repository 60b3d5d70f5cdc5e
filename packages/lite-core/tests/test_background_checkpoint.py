"""`save(..., blocking=False)` on one process: the state is copied at the call (CPU tensors too),
the write finishes in the background, a failed write is raised where the user waits (the next
save, `load`, `wait_for_checkpoint()`, the end of `run()`), process exit waits for the write, and
a strategy that cannot write in the background saves in the foreground with a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import linear_adam, squared_step  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.checkpoint import TorchCheckpointIO
from lite_core.errors import CheckpointError
from lite_core.strategies.single_device import SingleDeviceStrategy


class GatedIO(TorchCheckpointIO):
    """Writes only once `gate` is set; raises for paths that contain "broken"."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        assert self.gate.wait(30)
        if "broken" in os.fspath(path):
            raise OSError(28, "No space left on device")
        super().save(checkpoint, path)


def _setup(io: GatedIO) -> tuple[LightningLite, Any, Any]:
    return linear_adam(0.5, plugins=io)


_step = squared_step


def test_the_checkpoint_holds_the_state_of_the_call_while_later_steps_change_it(tmp_path: Path) -> None:
    io = GatedIO()
    lite, model, optimizer = _setup(io)
    _step(lite, model, optimizer)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    history = [1.0]
    io.gate.clear()  # the write waits until the loop below has changed every weight in place
    lite.save({"model": model, "optimizer": optimizer, "history": history}, tmp_path / "c.pt", blocking=False)
    for _ in range(3):
        _step(lite, model, optimizer)
    history.append(2.0)
    assert not (tmp_path / "c.pt").exists()
    io.gate.set()
    lite.wait_for_checkpoint()

    saved = torch.load(tmp_path / "c.pt")
    assert not torch.equal(model.weight, at_call["weight"])
    for name, value in at_call.items():
        assert torch.equal(saved["model"][name], value), name
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], moments)
    assert saved["optimizer"]["state"][0]["step"] == 1
    assert saved["history"] == [1.0]


@pytest.mark.parametrize("where", ["save", "load", "wait_for_checkpoint"])
def test_a_failed_background_write_raises_where_the_loop_next_waits(tmp_path: Path, where: str) -> None:
    lite, model, optimizer = _setup(GatedIO())
    lite.save({"model": model}, tmp_path / "ok.pt")
    lite.save({"model": model}, tmp_path / "broken.pt", blocking=False)
    calls = {
        "save": lambda: lite.save({"model": model}, tmp_path / "ok.pt", blocking=False),
        "load": lambda: lite.load(tmp_path / "ok.pt"),
        "wait_for_checkpoint": lite.wait_for_checkpoint,
    }
    with pytest.raises(CheckpointError, match=r"broken\.pt' failed on rank 0 with OSError .*No space left"):
        calls[where]()
    lite.wait_for_checkpoint()  # told once: nothing is in flight any more


def test_a_failed_background_write_fails_the_end_of_run(tmp_path: Path) -> None:
    io = GatedIO()

    def train(lite: LightningLite) -> str:
        model = lite.setup(nn.Linear(3, 2))
        io.gate.clear()
        lite.save({"model": model}, tmp_path / "broken.pt", blocking=False)
        io.gate.set()
        return "finished"

    with pytest.raises(CheckpointError, match="broken.pt' failed on rank 0"):
        LightningLite(accelerator="cpu", plugins=io).launch(train)


def test_the_next_save_and_load_wait_for_the_write_in_flight(tmp_path: Path) -> None:
    io = GatedIO()
    lite, model, optimizer = _setup(io)
    io.gate.clear()
    lite.save({"model": model, "step": 1}, tmp_path / "c.pt", blocking=False)
    timer = threading.Timer(0.3, io.gate.set)
    timer.start()
    assert lite.load(tmp_path / "c.pt")["step"] == 1  # would find no file without waiting
    timer.join()


def test_process_exit_waits_for_the_background_write(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    code = textwrap.dedent(f"""
        import time, torch
        from lite_core import LightningLite
        from lite_core.checkpoint import TorchCheckpointIO

        class SlowIO(TorchCheckpointIO):
            def save(self, checkpoint, path):
                time.sleep(1.0)
                super().save(checkpoint, path)

        LightningLite(accelerator="cpu", plugins=SlowIO()).save({{"x": torch.ones(3)}}, {str(path)!r}, blocking=False)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(torch.load(path)["x"], torch.ones(3))


class OwnFormatStrategy(SingleDeviceStrategy):
    name = "own_format"
    stages_checkpoints = False

    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: Any, precision: Any) -> None:
        super().save_checkpoint(path, content, checkpoint_io=checkpoint_io, precision=precision)


def test_a_strategy_that_cannot_save_in_the_background_saves_in_the_foreground_with_a_warning(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu", strategy=OwnFormatStrategy())
    with pytest.warns(UserWarning, match="writes .* before it returns under strategy='own_format': OwnFormatStrategy"
                                         " writes its checkpoints its own way"):
        lite.save({"x": torch.ones(2)}, tmp_path / "c.pt", blocking=False)
    assert torch.equal(torch.load(tmp_path / "c.pt")["x"], torch.ones(2))  # written before save returned


def test_consecutive_background_saves_each_hold_their_own_state(tmp_path: Path) -> None:
    """The second save copies into the first one's host buffers (reused once its write is done):
    each file must still hold the weights of its own call."""
    io = GatedIO()
    lite, model, optimizer = _setup(io)
    expected = []
    for name in ("a.pt", "b.pt"):
        _step(lite, model, optimizer)
        expected.append(model.weight.detach().clone())
        io.gate.clear()
        lite.save({"model": model}, tmp_path / name, blocking=False)
        _step(lite, model, optimizer)
        io.gate.set()
    lite.wait_for_checkpoint()
    assert not torch.equal(expected[0], expected[1])
    for name, weight in zip(("a.pt", "b.pt"), expected):
        assert torch.equal(torch.load(tmp_path / name)["model"]["weight"], weight), name


class PointerIO(TorchCheckpointIO):
    """Records the storage each write's weight was staged into."""

    def __init__(self) -> None:
        self.pointers: list[int] = []

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        self.pointers.append(checkpoint["model"]["weight"].data_ptr())
        super().save(checkpoint, path)


def test_a_background_save_stages_into_the_previous_saves_buffers_of_its_own_lite_only(tmp_path: Path) -> None:
    # The staging belongs to the save that staged (a module-level list filled by one call and
    # emptied by another was the call-order coupling): buffers go back to the LightningLite whose
    # save finished, and a copy made outside a background save is kept by nobody.
    from lite_core.checkpoint import stage_to_host

    first, second = PointerIO(), PointerIO()
    lites = [LightningLite(accelerator="cpu", plugins=io) for io in (first, second)]
    models = [lite.setup(nn.Linear(3, 2)) for lite in lites]
    for index in range(2):
        for lite, model in zip(lites, models):
            lite.save({"model": model}, tmp_path / f"{id(lite)}-{index}.pt", blocking=False)
            lite.wait_for_checkpoint()
        stage_to_host({"weight": models[0].weight})  # outside a save: neither lite's buffers
    assert first.pointers[0] == first.pointers[1] and second.pointers[0] == second.pointers[1]
    assert first.pointers[0] != second.pointers[0]
    for lite, model in zip(lites, models):
        assert torch.equal(torch.load(tmp_path / f"{id(lite)}-1.pt")["model"]["weight"], model.weight)
