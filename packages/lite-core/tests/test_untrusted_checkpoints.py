"""A checkpoint from a shared bucket cannot run code when loaded: a sharded checkpoint's `.metadata`
is read with an unpickler that knows only what torch distributed checkpoint writes there, on
every route that reads one (`load` with and without state, `consolidate`, a URL), and
`weights_only=False` is the one way to read it as torch does.

The same refusal under `strategy="fsdp"` (its own loading route) is checked by
`tests/scripts/fsdp_single_process.py`.
"""

from __future__ import annotations

import os
import pickle
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.checkpoint import consolidate
from lite_core.errors import CheckpointError


class _RunsACommand:
    """What the issue found: `os.system` called while `.metadata` is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch '{self.marker}'",)


class _CallsAMethodOfAnAllowedClass:
    """A bound method pickles as `getattr(obj, name)`: `PosixPath(marker).touch()` needs only a
    path (which `.metadata` may hold) and `getattr`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return self.marker.touch, ()


class _NamesAFunctionOfTorch:
    """`torch.float32` is allowed; `torch.save` is not."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return torch.save, ({"ran": True}, str(self.marker))


PAYLOADS = [_RunsACommand, _CallsAMethodOfAnAllowedClass, _NamesAFunctionOfTorch]


def _sharded_checkpoint(folder: Path) -> nn.Module:
    """A checkpoint folder in the format `fsdp` writes, made without a process group."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    torch.save({"step": 3}, folder / "lite_extra.pt")
    return model


def _plant(metadata: Path, payload: type, marker: Path) -> None:
    metadata.write_bytes(pickle.dumps(payload(marker)))


def _refused(load: Callable[[], Any], marker: Path) -> None:
    with pytest.raises(CheckpointError, match=r"call load\(\.\.\., weights_only=False\)") as info:
        load()
    message = str(info.value)
    assert message.endswith(".") and ". " not in message, message
    assert not marker.exists(), "the checkpoint's code ran"


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda payload: payload.__name__)
def test_a_sharded_checkpoint_whose_metadata_runs_code_is_refused_on_every_route(tmp_path: Path, payload: type) -> None:
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    _sharded_checkpoint(folder)
    _plant(folder / ".metadata", payload, marker)
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    _refused(lambda: lite.load(folder), marker)
    _refused(lambda: lite.load(folder, {"model": model}), marker)
    _refused(lambda: consolidate(folder, tmp_path / "one.pt"), marker)
    assert not (tmp_path / "one.pt").exists()
    # The documented way out reads it as torch does, and so the code runs: the payload is real.
    with pytest.raises(CheckpointError):
        lite.load(folder, weights_only=False)
    assert marker.exists()


def test_a_sharded_checkpoint_at_a_url_whose_metadata_runs_code_is_refused(tmp_path: Path) -> None:
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    _sharded_checkpoint(folder)
    _plant(folder / ".metadata", _RunsACommand, marker)
    url = f"memory://shared-bucket/{uuid.uuid4().hex[:8]}/ckpt"
    fs = fsspec.filesystem("memory")
    for file in folder.iterdir():
        fs.pipe_file(f"{url}/{file.name}", file.read_bytes())
    lite = LightningLite(accelerator="cpu")
    _refused(lambda: lite.load(url), marker)
    _refused(lambda: consolidate(url, tmp_path / "one.pt"), marker)


def test_what_torch_writes_in_metadata_still_loads(tmp_path: Path) -> None:
    """Every class torch puts there (sizes, dtypes, memory formats, layouts, chunk metadata, the
    saving path): the allow-list is not narrower than torch's writer."""
    model = _sharded_checkpoint(tmp_path / "ckpt")
    lite = LightningLite(accelerator="cpu")
    fresh = lite.setup(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    state = {"model": fresh, "step": 0}
    lite.load(tmp_path / "ckpt", state)
    assert state["step"] == 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    consolidate(tmp_path / "ckpt", tmp_path / "one.pt")
    assert torch.load(tmp_path / "one.pt", weights_only=True)["model"]["1.num_batches_tracked"] == 0


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path: Path) -> None:
    _sharded_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="not torch distributed checkpoint's metadata"):
        LightningLite(accelerator="cpu").load(tmp_path / "ckpt")


class _MakesAFolder:
    """torch refuses `posix.mkdir` as a blocked module, in other words than an unlisted class."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("payload", [_MakesAFolder, _RunsACommand], ids=lambda payload: payload.__name__)
def test_a_one_file_checkpoint_with_a_blocked_call_is_refused_as_unsafe_not_as_damaged(tmp_path: Path,
                                                                                      payload: type) -> None:
    marker = tmp_path / "ran"
    torch.save({"step": 1, "note": payload(marker)}, tmp_path / "shared.pt")
    lite = LightningLite(accelerator="cpu")
    _refused(lambda: lite.load(tmp_path / "shared.pt"), marker)
    url = f"memory://shared-bucket/{uuid.uuid4().hex[:8]}/shared.pt"
    fsspec.filesystem("memory").pipe_file(url, (tmp_path / "shared.pt").read_bytes())
    _refused(lambda: lite.load(url), marker)


class _TaggedTensor(torch.Tensor):
    """A tensor class of the user's own (as a library's parameter wrapper is to a plain process)."""


def test_shards_of_a_class_safe_loading_refuses_are_reported_as_refused_not_as_damaged(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    weight = torch.Tensor._make_subclass(_TaggedTensor, torch.ones(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"weight": weight}}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    torch.save({}, tmp_path / "ckpt" / "lite_extra.pt")
    with pytest.raises(CheckpointError, match=r"holds pickled \S*_TaggedTensor objects, which torch's safe") as info:
        consolidate(tmp_path / "ckpt", tmp_path / "one.pt")
    message = str(info.value)
    assert message.endswith(".") and ". " not in message and "damaged" not in message, message
