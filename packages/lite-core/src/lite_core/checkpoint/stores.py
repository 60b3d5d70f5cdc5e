"""Where checkpoints are kept, behind one interface: a `Store` owns a kind of path (this machine's
file system, fsspec URLs, or one a backend registers) and its commit rule, the way a checkpoint
written there is complete or absent at every moment.

Lite decides once per path which store it is (`store_for`), and every piece of checkpoint code
then asks that store: whether something is there, how to write one file so that it is complete or
absent, how a folder of shards is started and committed, what a missing or unfinished checkpoint
says. Two stores come with Lite:

- `LocalStore`, for local paths: a temporary file or staging folder beside the path, renamed
  into place (see `lite_core.checkpoint._local`);
- `FsspecStore`, for fsspec URLs (`s3://...`, `gs://...`, `memory://...`): a pending marker
  beside the checkpoint while it uploads, a temporary key copied to the name, `.metadata` last for
  a sharded checkpoint (see `lite_core.checkpoint._store`).

A store for another kind of path is a subclass of `Store` registered for its URL protocol
(`register_store("toy", ToyStore)`); `save`, `load` and `latest` then use it for every path
`toy://...`.

Example:
    >>> from lite_core.plugins import register_store
    >>> register_store("toy", ToyStore)  # doctest: +SKIP
    >>> lite.save("toy://run/step-1", {"model": model})  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, TypeVar

import torch

from lite_core.checkpoint import _local, _store
from lite_core.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

T = TypeVar("T")


class WritesFiles(Protocol):
    """What a store asks of the checkpoint IO plugin when it commits a sharded checkpoint."""

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None: ...

    def save_part(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None: ...


class Store(ABC):
    """A kind of path where checkpoints are kept, and its commit rule.

    A subclass answers for every path that `store_for` gives it; it is created without arguments
    (or by the factory passed to `register_store`) and keeps no state between calls, so every
    process of a job makes its own. Paths are passed as `str`, as the user wrote them.
    """

    #: Whether every node of a job sees the same checkpoint at a path (an object store), rather
    #: than each node its own copy (a local disk): a job whose groups save the same bytes then
    #: lets one group write them (`lite_torchft`).
    shared: ClassVar[bool] = True
    #: Whether a path is a folder of this machine's file system that any library can open (what
    #: `load_safetensors` reads from).
    local: ClassVar[bool] = False

    # -- paths ---------------------------------------------------------------------------------
    def check(self, path: str, strategy: Any = None) -> None:
        """Refuse `path` before anything is written or read, in one sentence: by default a path of
        a store that is not `local` when `strategy` writes local files only
        (`Strategy.checkpoint_urls`); a store adds its own refusals (a missing back end)."""
        if strategy is not None and not self.local and not type(strategy).checkpoint_urls:
            raise CheckpointError(
                f"strategy={strategy.name!r} writes and reads checkpoints on the local file system only, so it"
                f" cannot use '{path}': save to a local path (and copy it to the store yourself) or choose a"
                " strategy whose checkpoints go to URLs (single_device, ddp, fsdp, model_parallel)."
            )

    @abstractmethod
    def join(self, path: str, name: str) -> str:
        """The path of `name` inside the folder `path`."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether anything (a file or a folder) is at `path`."""

    @abstractmethod
    def is_file(self, path: str) -> bool:
        """Whether a file is at `path`."""

    @abstractmethod
    def filesystem(self, path: str) -> tuple[AbstractFileSystem, str]:
        """An fsspec file system that lists the folder `path` and the name of `path` in it: what
        `latest` reads (`ls`, `modified`, `open`)."""

    # -- one-file checkpoints ------------------------------------------------------------------
    @abstractmethod
    def save_file(self, checkpoint: dict[str, Any], path: str) -> None:
        """`torch.save` of `checkpoint` to `path` so that a reader finds the previous checkpoint or
        the new one there, never a part of it, whatever happens meanwhile; a checkpoint folder
        saved there under another strategy is replaced."""

    def save_part(self, checkpoint: dict[str, Any], path: str) -> None:
        """`torch.save` of `checkpoint` to `path` inside a sharded checkpoint folder that is
        committed as a whole later (`commit_sharded`); by default `save_file`."""
        self.save_file(checkpoint, path)

    @abstractmethod
    def load_file(self, path: str, weights_only: bool) -> dict[str, Any]:
        """`torch.load` (to the CPU) of the one-file checkpoint at `path`; raise `CheckpointError`
        where nothing is there."""

    # -- sharded checkpoints (torch distributed checkpoint) ------------------------------------
    @abstractmethod
    def shard_writer(self, folder: str) -> Any:
        """Torch distributed checkpoint's storage writer for the folder `start_sharded` returned."""

    @abstractmethod
    def shard_reader(self, path: str) -> Any:
        """Torch distributed checkpoint's storage reader for the sharded checkpoint at `path`."""

    @abstractmethod
    def start_sharded(self, path: str, extra: dict[str, Any], io: WritesFiles) -> str:
        """Rank 0, before any rank writes a shard of the checkpoint `path`: prepare it, and return
        the folder that every rank writes its shards into (`extra`, the values besides the
        shards, goes into `lite_extra.pt` of that folder, written here or at `commit_sharded`)."""

    @abstractmethod
    def commit_sharded(self, folder: str, path: str, extra: dict[str, Any], io: WritesFiles,
                       started: float) -> None:
        """Rank 0, once every rank wrote its shards into `folder` (and torch its `.metadata`):
        make the checkpoint at `path` complete; `started` is when the save began."""

    # -- folders of files ----------------------------------------------------------------------
    @abstractmethod
    def write_folder(self, path: str, write: Callable[[str], T], last: str) -> T:
        """`write(folder)` writes files into a local folder, which end up in the folder `path`,
        the file named `last` after every other one (an index that says the folder is whole)."""

    # -- reading -------------------------------------------------------------------------------
    def to_read(self, path: str) -> str:
        """The path that `load(path)` reads: `path`, or what an interrupted save left to read
        instead; an unfinished save there is refused in one sentence."""
        return path

    def missing(self, path: str) -> CheckpointError:
        """The error for a load of `path` where no checkpoint is."""
        return CheckpointError(f"No checkpoint at '{path}': check the path you passed to load().")

    def save_failure_fix(self, failure: str) -> str:
        """What to do about a save that failed with `failure` (`"OSError (...)"`, the failing
        rank's error as every rank has it): the end of a sentence."""
        return ("fix that cause (free disk space, remove what is in the way, or save only tensors, plain"
                " values and objects with state_dict()) and save again")


class LocalStore(Store):
    """This machine's file system: a temporary file or staging folder beside the path, renamed
    into place (see `lite_core.checkpoint._local`)."""

    shared = False
    local = True

    def check(self, path: str, strategy: Any = None) -> None:
        _store.refuse_flattened_url(path)

    def join(self, path: str, name: str) -> str:
        return os.path.join(path, name)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def filesystem(self, path: str) -> tuple[AbstractFileSystem, str]:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(), path

    def save_file(self, checkpoint: dict[str, Any], path: str) -> None:
        _local.save_file(checkpoint, path)

    def load_file(self, path: str, weights_only: bool) -> dict[str, Any]:
        if not os.path.isfile(path):
            raise CheckpointError(f"No checkpoint file at '{path}': check the path you passed to load().")
        return torch.load(path, map_location="cpu", weights_only=weights_only)

    def shard_writer(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(folder)

    def shard_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)

    def start_sharded(self, path: str, extra: dict[str, Any], io: WritesFiles) -> str:
        return _local.staging_folder(Path(path))

    def commit_sharded(self, folder: str, path: str, extra: dict[str, Any], io: WritesFiles,
                       started: float) -> None:
        io.save(extra, os.path.join(folder, _store.EXTRA_FILE))
        _local.commit_folder(Path(folder), Path(path), started)

    def write_folder(self, path: str, write: Callable[[str], T], last: str) -> T:
        return write(path)

    def to_read(self, path: str) -> str:
        return _local.existing_or_previous(path)


class FsspecStore(Store):
    """A URL of an fsspec file system (an object store: S3, GCS, Azure, ...): a pending marker
    while a checkpoint uploads, a temporary key copied to its name, `.metadata` last for a
    sharded checkpoint (see `lite_core.checkpoint._store`)."""

    def check(self, path: str, strategy: Any = None) -> None:
        super().check(path, strategy)
        _store.check_url(path)

    def join(self, path: str, name: str) -> str:
        return _store.join(path, name)

    def exists(self, path: str) -> bool:
        fs, key = _store.filesystem(path)
        return fs.exists(key)

    def is_file(self, path: str) -> bool:
        fs, key = _store.filesystem(path)
        return fs.isfile(key)

    def filesystem(self, path: str) -> tuple[AbstractFileSystem, str]:
        return _store.filesystem(path)

    def save_file(self, checkpoint: dict[str, Any], path: str) -> None:
        _store.save_file(checkpoint, path)

    def save_part(self, checkpoint: dict[str, Any], path: str) -> None:
        _store.put_file(checkpoint, path)

    def load_file(self, path: str, weights_only: bool) -> dict[str, Any]:
        return _store.load_file(path, weights_only)

    def shard_writer(self, folder: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No fsync: an object store has none, and torch would fall back to syncing every disk.
        return FsspecWriter(folder, sync_files=False)

    def shard_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)

    def start_sharded(self, path: str, extra: dict[str, Any], io: WritesFiles) -> str:
        # Written in place, `.metadata` last: the marker, the previous checkpoint removed, the values.
        _store.begin(path)
        _store.clear_sharded(path)
        io.save_part(extra, _store.join(path, _store.EXTRA_FILE))
        return path

    def commit_sharded(self, folder: str, path: str, extra: dict[str, Any], io: WritesFiles,
                       started: float) -> None:
        _store.end(path)  # torch wrote `.metadata`: the checkpoint is complete

    def write_folder(self, path: str, write: Callable[[str], T], last: str) -> T:
        with tempfile.TemporaryDirectory(prefix="lite-export-") as local:
            result = write(local)
            fs, key = _store.filesystem(path)
            for name in sorted(os.listdir(local), key=lambda name: name == last):
                fs.put_file(os.path.join(local, name), f"{key.rstrip('/')}/{name}")
        return result

    def to_read(self, path: str) -> str:
        _store.require_complete(path)  # an unfinished upload is refused, not taken for "missing"
        return path

    def missing(self, path: str) -> CheckpointError:
        return _store.missing(path)

    def save_failure_fix(self, failure: str) -> str:
        kinds = {"PermissionError": PermissionError(), "FileNotFoundError": FileNotFoundError()}
        return _store.store_hint(kinds.get(failure.split(" ", 1)[0], OSError()))


_STORES: dict[str, Callable[[], Store]] = {}
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


def register_store(protocol: str, factory: Callable[[], Store]) -> None:
    """Make `factory()` (a `Store` subclass, or a function returning a store) the store of every
    path `PROTOCOL://...`, in this process; registering a protocol again replaces its store.

    Call it where every process of the job runs it (at import of the module that defines the
    store, or at the top of the script), before the first `save` or `load` of such a path.

    Example:
        >>> register_store("toy", ToyStore)  # doctest: +SKIP
    """
    if _PROTOCOL.fullmatch(protocol) is None:
        raise ConfigurationError(f"register_store got protocol={protocol!r}, which is not a URL protocol:"
                                 " pass its name without '://', such as 'toy'.")
    _STORES[protocol] = factory


def store_for(path: str | os.PathLike[str]) -> Store:
    """The store of `path`: the one registered for its URL protocol (`register_store`), else
    `FsspecStore` for any other URL (`s3://...`, `simplecache::s3://...`), else `LocalStore`
    (a `pathlib.Path` is always local). Pass `file://` URLs through `as_local` first."""
    if not isinstance(path, str) or not _store.is_url(path):
        return LocalStore()
    factory = _STORES.get(_store.protocols(path)[0])
    return factory() if factory is not None else FsspecStore()


def as_local(path: str) -> str:
    """`file:///x` as the local path `/x` (written the local, atomic way); any other path as it is."""
    return _store.as_local(path)


def check_path(path: str, strategy: Any = None) -> None:
    """`store_for(path).check(path, strategy)`: refuse `path` before anything is written or read."""
    store_for(path).check(path, strategy)
