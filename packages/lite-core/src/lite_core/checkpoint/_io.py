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
from lite_core.checkpoint._store import (
    METADATA_FILE,
    READER_FILE,
    _host,
    is_url,
    load_file,
    put_file,
    running,
    save_file,
    writer,
)
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
    path removes such leftovers (see `remove_stale_temporaries`). Where `path` holds a checkpoint
    folder written under another strategy (a sharded checkpoint, or a backend's own format), the
    new file replaces it as `put_in_place` says; any other folder there fails the save.
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
            if _is_checkpoint_folder(target):  # saved under another strategy
                put_in_place(Path(tmp), target)
            else:  # a folder of anything else is refused by the rename: nothing of the user's is removed
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


def put_in_place(new: Path, target: Path) -> None:
    """Rename `new` (a checkpoint file, or a sharded checkpoint's folder) to `target`, replacing
    the checkpoint there whatever its layout: a path keeps working when the strategy that saves
    to it changes (a folder of shards saved under `fsdp`, then one file under `ddp`, or back).

    A file replaces a file (or nothing) in one atomic rename. Where a folder is involved no single
    rename can replace it, so the previous checkpoint is first moved aside, into
    `.NAME.HOST-PID.XXXXXXXX.old/NAME` beside `target`, and `new` then takes its place: if the
    process dies between the two renames, `load` reads the previous checkpoint from there
    (`existing_or_previous`) and the next successful save of `target` removes it
    (`remove_stale_temporaries`). Either the previous or the new checkpoint is loadable at every
    moment.
    """
    if not _is_folder(target) and not (new.is_dir() and os.path.lexists(target)):
        os.replace(new, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.{writer()}.", suffix=".old", dir=target.parent))
    os.replace(target, aside / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside / target.name, target)  # the previous checkpoint back; if this fails, load finds it aside
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def staging_folder(target: Path) -> str:
    """A new, empty folder beside `target` (`.NAME.HOST-PID.XXXXXXXX.tmp`) to write a checkpoint
    folder into before `commit_folder` puts it at `target`; call it on one rank."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{target.name}.{writer()}.", suffix=".tmp", dir=target.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0o700 would hide the checkpoint from other users
    return staging


def commit_folder(staging: Path, target: Path, started: float) -> None:
    """Put the finished checkpoint folder `staging` at `target`, over a folder or a file saved
    under another strategy (`put_in_place`), and remove what interrupted saves of `target` left
    since before `started` (`remove_stale_temporaries`); call it on one rank."""
    put_in_place(staging, target)
    remove_stale_temporaries(target, started)


def _is_checkpoint_folder(path: Path) -> bool:
    """Whether `path` is a folder that holds a checkpoint: a sharded one (its `.metadata`) or a
    backend's own format (its `READER_FILE`)."""
    return _is_folder(path) and any((path / name).is_file() for name in (METADATA_FILE, READER_FILE))


def _is_folder(path: Path) -> bool:
    """Whether `path` is a folder itself (a link to one is replaced as a file is)."""
    return path.is_dir() and not path.is_symlink()


def remove_stale_temporaries(target: Path, started: float) -> None:
    """Remove what interrupted saves of `target` left beside it: the temporary files of one-file
    saves, the staging folders of sharded saves, and the folders holding a checkpoint that a save
    moved aside to replace it (`put_in_place`). Every save of `target`, whatever its layout,
    removes all three kinds, so a path whose strategy changed is cleaned up too.

    A leftover is removed when its writer is known to be gone: a process of this host that no
    longer runs. A temporary of another host (a shared file system), or one without a writer in
    its name (written by an older version), is removed only if nothing wrote to it (or, for a
    folder, to the files in it) since `started` (when the current save began): a concurrent
    writer that is still writing keeps touching it. Temporaries of other paths and of live
    writers on this host are never touched.
    """
    pattern = _leftover_pattern(target, "tmp|old")
    for candidate in target.parent.iterdir():
        match = pattern.fullmatch(candidate.name)
        if match is None or not _is_stale(candidate, match, started):
            continue
        if _is_folder(candidate):
            shutil.rmtree(candidate, ignore_errors=True)
        else:
            candidate.unlink(missing_ok=True)


def _leftover_pattern(target: Path, kinds: str) -> re.Pattern[str]:
    """Names of what saves of `target` leave beside it: `.NAME.HOST-PID.XXXXXXXX.KIND` (an older
    version wrote no `HOST-PID.`); `.tmp` is a file or staging folder being written, `.old` the
    folder a save moves the previous checkpoint into while it replaces it (`put_in_place`)."""
    return re.compile(rf"\.{re.escape(target.name)}\.(?:(?P<host>[^.]+)-(?P<pid>\d+)\.)?[a-z0-9_]+\.(?:{kinds})")


def previous_checkpoint(target: Path) -> Path | None:
    """When nothing is at `target`: the previous checkpoint (a file or a folder) that a save moved
    aside to replace it (`.NAME.HOST-PID.XXXXXXXX.old/NAME`, see `put_in_place`) and that stayed
    there because the save was interrupted between its two renames; the newest if there are several."""
    if target.exists() or not target.parent.is_dir():
        return None
    pattern = _leftover_pattern(target, "old")
    kept = [folder / target.name for folder in target.parent.iterdir()
            if pattern.fullmatch(folder.name) and (folder / target.name).exists()]
    return max(kept, key=lambda path: path.stat().st_mtime, default=None)


def existing_or_previous(path: str) -> str:
    """`path`, or, when nothing is there, the previous checkpoint an interrupted save of `path`
    left aside (with a warning)."""
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
        return int(match["pid"]) != os.getpid() and not running(int(match["pid"]))
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
