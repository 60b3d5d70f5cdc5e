"""Checkpoint IO: how a checkpoint's bytes reach the disk and come back."""

from __future__ import annotations

import os
import pickle
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from lite_core.errors import CheckpointError


class CheckpointIO(ABC):
    """Writes and reads one checkpoint file; pass an instance in `plugins` to replace it."""

    @abstractmethod
    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Write `checkpoint` to `path`."""

    @abstractmethod
    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        """Read the checkpoint at `path`."""


class TorchCheckpointIO(CheckpointIO):
    """`torch.save` to a temporary file renamed into place; `torch.load` with `weights_only`.

    A crash while writing leaves the previous file at `path` intact.
    """

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        source = Path(path)
        if not source.is_file():
            raise CheckpointError(f"No checkpoint file at '{source}': check the path you passed to load().")
        try:
            return torch.load(source, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as err:
            if weights_only and "Unsupported global" in str(err):
                raise CheckpointError(
                    f"The checkpoint '{source}' holds pickled Python objects that safe loading refuses:"
                    " if you trust the file, call load(..., weights_only=False)."
                ) from err
            raise _unreadable(source) from err
        except Exception as err:  # torch raises many types for a damaged or foreign file
            raise _unreadable(source) from err


def _unreadable(source: Path) -> CheckpointError:
    return CheckpointError(
        f"The file '{source}' is truncated or is not a checkpoint written by torch.save: point"
        " load() at a complete checkpoint."
    )


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
