"""The local file system's commit rule: how a checkpoint file or folder on this machine's disk is
complete or absent at every moment, and what interrupted saves leave beside it.

- A one-file checkpoint is written by `torch.save` to a temporary file beside its path
  (`.NAME.HOST-PID.XXXXXXXX.tmp`), flushed to disk and renamed into place (`save_file`).
- A checkpoint folder (a sharded checkpoint, or a backend's own format) is written into a staging
  folder beside its path (`staging_folder`) and renamed into place (`commit_folder`), replacing
  whatever layout was there (`put_in_place`).
- The next successful save of a path removes what interrupted saves of it left
  (`remove_stale_temporaries`); `load` reads the checkpoint a save moved aside when it was
  interrupted between its two renames (`existing_or_previous`).

`lite_core.checkpoint.stores.LocalStore` is this rule behind the `Store` interface.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lite_core._user_frame import warn_user
from lite_core.checkpoint._store import METADATA_FILE, READER_FILE, _host, running, writer


def save_file(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """`torch.save` of `checkpoint` to a temporary file beside `path`, flushed to disk (`fsync`) and
    renamed into place; a checkpoint folder saved there under another strategy is replaced as
    `put_in_place` says, and any other folder there fails the save."""
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
