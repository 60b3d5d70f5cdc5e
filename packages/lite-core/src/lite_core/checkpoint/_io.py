"""Checkpoint IO: how a checkpoint's bytes reach the disk and come back."""

from __future__ import annotations

import os
import pickle
from abc import ABC, abstractmethod
from typing import Any

from lite_core.checkpoint.stores import store_for
from lite_core.errors import CheckpointError


class CheckpointIO(ABC):
    """Writes and reads one checkpoint file; pass an instance in `plugins` to replace it."""

    @abstractmethod
    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Write `checkpoint` to `path`."""

    @abstractmethod
    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        """Read the checkpoint at `path`."""

    def save_part(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Write `checkpoint` to `path` inside a sharded checkpoint directory, whose commit marker
        (`.metadata`) is written after it: the file needs no commit of its own. By default `save`."""
        self.save(checkpoint, path)


class TorchCheckpointIO(CheckpointIO):
    """`torch.save` to a temporary file, flushed to disk and renamed into place; `torch.load`
    with `weights_only`.

    The file is durable when `save` returns: its bytes are on the disk (`fsync`), not only in
    the page cache, so a power loss or a lost machine cannot leave a checkpoint of zeros under
    the final name. The disk write is started while `torch.save` still serialises (see
    `lite_core.checkpoint._local`), so the flush at the end waits for little.

    A crash while writing leaves the previous file at `path` intact, and its temporary file
    (`.NAME.HOST-PID.XXXXXXXX.tmp` beside `path`) behind; the next successful save of the same
    path removes such leftovers (see `_local.remove_stale_temporaries`). Where `path` holds a checkpoint
    folder written under another strategy (a sharded checkpoint, or a backend's own format), the
    new file replaces it as `_local.put_in_place` says; any other folder there fails the save.

    That is the local file system's commit rule (`LocalStore`); a URL is written and read by its
    own store's rule (`lite_core.checkpoint.stores.store_for`).
    """

    def save_part(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Written as the path's store writes a file inside a sharded checkpoint folder: at a URL
        one upload, without the pending marker and the temporary key of a one-file checkpoint."""
        store_for(path).save_part(checkpoint, os.fspath(path))

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        store_for(path).save_file(checkpoint, os.fspath(path))  # see `lite_core.checkpoint.stores`

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        store = store_for(path)
        source = os.fspath(path)
        try:
            return store.load_file(source, weights_only)
        except CheckpointError:  # the store said why (nothing there, an unfinished upload)
            raise
        except pickle.UnpicklingError as err:
            # torch words it "Unsupported global: GLOBAL x" or "unsupported GLOBAL x whose module
            # is blocked" (os, subprocess, ... since torch 2.6)
            if weights_only and "unsupported global" in str(err).lower():
                raise CheckpointError(
                    f"The checkpoint '{source}' holds pickled Python objects that safe loading refuses:"
                    " if you trust the file, call load(..., weights_only=False)."
                ) from err
            raise _unreadable(source) from err
        except Exception as err:  # torch raises many types for a damaged or foreign file
            raise _unreadable(source) from err


def _unreadable(source: str) -> CheckpointError:
    return CheckpointError(
        f"The file '{source}' is truncated or is not a checkpoint written by torch.save: point"
        " load() at a complete checkpoint."
    )
