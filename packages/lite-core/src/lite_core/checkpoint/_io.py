"""Checkpoint IO: how a checkpoint's bytes reach the disk and come back."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lite_core._user_frame import warn_user
from lite_core.checkpoint._store import _host, is_url, load_file, put_file, save_file, writer
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
    `_WritebackAhead`), so the flush at the end waits for little.

    A crash while writing leaves the previous file at `path` intact, and its temporary file
    (`.NAME.HOST-PID.XXXXXXXX.tmp` beside `path`) behind; the next successful save of the same
    path removes such leftovers (see `remove_stale_temporaries`).
    """

    def save_part(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """At a URL one upload (`put_file`), without the pending marker and the temporary key of a
        one-file checkpoint; a local path as `save`."""
        if isinstance(path, str) and is_url(path):
            put_file(checkpoint, path)
            return
        self.save(checkpoint, path)

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        if isinstance(path, str) and is_url(path):
            save_file(checkpoint, path)  # an fsspec URL: see `lite_core.checkpoint._store`
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{writer()}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, _WritebackAhead(handle))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)
        remove_stale_temporaries(target, started)

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
        remote = isinstance(path, str) and is_url(path)
        source = path if remote else Path(path)
        if not remote and not source.is_file():
            raise CheckpointError(f"No checkpoint file at '{source}': check the path you passed to load().")
        try:
            if remote:
                return load_file(path, weights_only)
            return torch.load(source, map_location="cpu", weights_only=weights_only)
        except CheckpointError:  # the store said why (a URL)
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


class _WritebackAhead:
    """A file to write to that hands each written stretch of `chunk_bytes` to the kernel's
    writeback at once, while the writer goes on producing the next.

    On its own a large write only fills the page cache, and the `fsync` that makes it durable
    then waits for the whole file to reach the disk. `posix_fadvise(POSIX_FADV_DONTNEED)` on a
    written range starts that range's writeback without waiting for it (and lets the kernel drop
    the pages once they are clean), so disk and serialisation overlap. Where the call does not
    exist (not Linux or another POSIX system that has it) the writes pass through unchanged.
    """

    def __init__(self, handle: BinaryIO, chunk_bytes: int = 8 << 20) -> None:
        self._handle = handle
        self._chunk_bytes = chunk_bytes
        self._written = 0
        self._handed_over = 0
        self._advise = getattr(os, "posix_fadvise", None)

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")  # a tensor's storage arrives in one write: hand it over in slices
        for start in range(0, len(view), self._chunk_bytes):
            self._written += self._handle.write(view[start:start + self._chunk_bytes])
            if self._advise is not None and self._written - self._handed_over >= self._chunk_bytes:
                self._hand_over()
        return len(view)

    def flush(self) -> None:
        self._handle.flush()

    def _hand_over(self) -> None:
        self._handle.flush()
        try:
            self._advise(self._handle.fileno(), self._handed_over, self._written - self._handed_over,
                         os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system without it: the final fsync does all the work
            self._advise = None
        self._handed_over = self._written


def remove_stale_temporaries(target: Path, started: float, folders: bool = False) -> None:
    """Remove the temporary files (with `folders=True`: a sharded save's staging folders and the
    folders holding the checkpoint it replaced) that interrupted saves of `target` left beside it.

    A leftover is removed when its writer is known to be gone: a process of this host that no
    longer runs. A temporary of another host (a shared file system), or one without a writer in
    its name (written by an older version), is removed only if nothing wrote to it (or, for a
    folder, to the files in it) since `started` (when the current save began): a concurrent
    writer that is still writing keeps touching it. Temporaries of other paths, of live writers on
    this host, and those of the other kind (a one-file save leaves folders alone) are never touched.
    """
    pattern = _leftover_pattern(target, "tmp|old" if folders else "tmp")
    for candidate in target.parent.iterdir():
        match = pattern.fullmatch(candidate.name)
        if match is None or candidate.is_dir() != folders or not _is_stale(candidate, match, started):
            continue
        if folders:
            shutil.rmtree(candidate, ignore_errors=True)
        else:
            candidate.unlink(missing_ok=True)


def _leftover_pattern(target: Path, kinds: str) -> re.Pattern[str]:
    """Names of what saves of `target` leave beside it: `.NAME.HOST-PID.XXXXXXXX.KIND` (an older
    version wrote no `HOST-PID.`); `.tmp` is a file or staging folder being written, `.old` the
    folder a sharded save moves the previous checkpoint into while it replaces it."""
    return re.compile(rf"\.{re.escape(target.name)}\.(?:(?P<host>[^.]+)-(?P<pid>\d+)\.)?[a-z0-9_]+\.(?:{kinds})")


def previous_checkpoint(target: Path) -> Path | None:
    """When nothing is at `target`: the previous checkpoint that a sharded save moved aside to
    replace it (`.NAME.HOST-PID.XXXXXXXX.old/NAME`) and could not put back because it was
    interrupted between its two renames; the newest if there are several."""
    if target.exists() or not target.parent.is_dir():
        return None
    pattern = _leftover_pattern(target, "old")
    kept = [folder / target.name for folder in target.parent.iterdir()
            if pattern.fullmatch(folder.name) and (folder / target.name).exists()]
    return max(kept, key=lambda path: path.stat().st_mtime, default=None)


def existing_or_previous(path: str) -> str:
    """`path`, or, when nothing is there, the previous checkpoint an interrupted sharded save of
    `path` left aside (with a warning)."""
    previous = previous_checkpoint(Path(path))
    if previous is None:
        return path
    warn_user(
        f"No checkpoint at '{path}': a save that was replacing it was interrupted, so the previous"
        f" checkpoint is loaded from '{previous}' (the next successful save of the path removes it)."
    )
    return str(previous)


def _is_stale(candidate: Path, match: re.Match[str], started: float) -> bool:
    if match["host"] == _host():
        return int(match["pid"]) != os.getpid() and not _running(int(match["pid"]))
    try:
        return _last_change(candidate) < started
    except OSError:  # gone already
        return False


def _last_change(candidate: Path) -> float:
    """When `candidate` (a file, or a folder and the files directly in it) was last written."""
    changed = candidate.stat().st_mtime
    if candidate.is_dir():
        changed = max([changed, *(entry.stat().st_mtime for entry in candidate.iterdir())])
    return changed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unreadable(source: Path | str) -> CheckpointError:
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
