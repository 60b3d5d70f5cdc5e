"""Checkpoints at fsspec URLs (`s3://bucket/run/step-100`, `gs://...`, `az://...`, `memory://...`):
how Lite tells a URL from a local path, checks that its fsspec back end is installed, writes a
one-file checkpoint so that it is complete or absent, and tells an unfinished upload from a
missing checkpoint. `lite_core.checkpoint.stores.FsspecStore` is this rule behind the `Store`
interface; nothing outside the store modules asks whether a path is a URL.

The commit rule (object stores have no atomic rename):

- Before a save to a URL writes anything, rank 0 puts a small *pending marker* beside the
  checkpoint (`.NAME.lite-pending`), and removes it once the checkpoint is complete.
- A one-file checkpoint is uploaded to a temporary key beside it (`.NAME.HOST-PID.XXXXXXXX.tmp`)
  and then copied to its name (on S3, GCS and Azure a copy publishes the whole object or nothing),
  so the previous checkpoint at that name stays readable until the new one is complete. Once it
  is, the temporary keys that earlier, interrupted saves of that name left are removed.
- A sharded checkpoint (torch distributed checkpoint, `FsspecWriter`) is complete when its
  `.metadata` exists: torch writes it last, once every rank's shards are written. Saving over an
  existing sharded checkpoint at a URL first removes its `.metadata`, then the rest, so that a
  load can never mix old and new shards.
- `load` of a name without a checkpoint but with a pending marker, or of a sharded directory
  without `.metadata`, says that the upload never finished.

Credentials and endpoints are the fsspec back end's own: environment variables
(`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...) or fsspec's configuration (`FSSPEC_S3='{...}'`,
`fsspec.config.conf`), which every process reads when it opens the URL.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import socket
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch

from lite_core.errors import CheckpointError, MissingDependencyError
from lite_core._install import install_hint

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

#: The marker a save to a URL keeps beside the checkpoint while it uploads: `.NAME` + this.
PENDING_SUFFIX = ".lite-pending"
#: The file torch distributed checkpoint writes last into a sharded checkpoint.
METADATA_FILE = ".metadata"
#: A text file in a backend's checkpoint directory that names the strategy (registered in
#: `lite_core.strategies`) whose `read_whole_checkpoint` reads the directory under any strategy.
READER_FILE = "lite_reader"
#: The extra (`pip install 'lite-core[EXTRA]'`) that installs the fsspec back end of a protocol.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
           "abfss": "azure", "adl": "azure"}
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_CHAINED_URL = re.compile(r"(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*)::")
#: What `pathlib.Path` makes of a URL: `s3://b/k` -> `s3:/b/k`.
_FLATTENED_URL = re.compile(r"(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*):/(?!/)")
_LOCAL_PROTOCOLS = ("file", "local")
#: The file of a sharded checkpoint that holds everything except module and optimizer tensors.
EXTRA_FILE = "lite_extra.pt"


def is_url(path: str) -> bool:
    """Whether `path` names a place through an fsspec protocol (`s3://...`, `memory://...`,
    `simplecache::s3://...`) rather than a local path."""
    if _URL.match(path) is not None:
        return True
    chained = _CHAINED_URL.match(path)  # `NAME::...` is a URL only where fsspec knows NAME
    return chained is not None and _known(chained["protocol"])


def as_local(path: str) -> str:
    """`file:///x` as the local path `/x` (written the local, atomic way); any other path as it is."""
    for protocol in _LOCAL_PROTOCOLS:
        if path.startswith(f"{protocol}://"):
            return path[len(protocol) + 3:]
    return path


def check_url(url: str) -> None:
    """Refuse, before anything is written or read, a URL whose fsspec back end is missing."""
    for protocol in protocols(url):
        _check_backend(url, protocol)


def refuse_flattened_url(path: str) -> None:
    """Refuse a local path that is a URL `pathlib.Path` has flattened (`s3:/bucket/key`)."""
    match = _FLATTENED_URL.match(path)
    if match is None or match["protocol"] in _LOCAL_PROTOCOLS or not _known(match["protocol"]):
        return
    raise CheckpointError(
        f"'{path}' looks like a URL that pathlib.Path turned into a local path ('{match['protocol']}:/'"
        f" instead of '{match['protocol']}://'): pass the URL as a str."
    )


def protocols(url: str) -> list[str]:
    """The protocols of a (possibly chained) URL: `simplecache::s3://b/k` -> `["simplecache", "s3"]`."""
    return [part.split("://", 1)[0] for part in url.split("::") if part]


def _known(protocol: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return protocol in known_implementations or protocol in registry


def _check_backend(url: str, protocol: str) -> None:
    import fsspec

    if not _known(protocol):
        raise CheckpointError(f"fsspec knows no protocol '{protocol}://' in '{url}': check the URL, or"
                              " install the package that registers that protocol.")
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        extra = _EXTRAS.get(protocol)
        install = install_hint(extra) if extra else f"install fsspec's back end for '{protocol}'"
        raise MissingDependencyError(
            f"Checkpoints at '{url}' need the fsspec back end for '{protocol}://', which is not installed: {install}."
        ) from err


def writer() -> str:
    """This process as a temporary file names its writer: `HOST-PID` (dots in the host name become `_`)."""
    return f"{_host()}-{os.getpid()}"


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def running(pid: int) -> bool:
    """Whether process `pid` of this host is running (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- paths ---------------------------------------------------------------------------------------
def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec file system of `url` and the path within it, with nothing about it taken from
    the listings fsspec caches (another process may have written there since)."""
    from fsspec.core import url_to_fs

    fs, key = url_to_fs(url)
    fs.invalidate_cache(key)
    return fs, key


def join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def _beside(url: str, name: str) -> str:
    """The URL of `name` in the same folder as `url`."""
    parent, _, _ = url.rstrip("/").rpartition("/")
    return f"{parent}/{name}"


def _name(url: str) -> str:
    return url.rstrip("/").rpartition("/")[2]


def pending_marker(url: str) -> str:
    return _beside(url, f".{_name(url)}{PENDING_SUFFIX}")


# -- writing -------------------------------------------------------------------------------------
def begin(url: str) -> None:
    """Rank 0, before a save to `url` writes anything: put the pending marker (which also proves
    that the bucket exists and the credentials may write)."""
    fs, marker = filesystem(pending_marker(url))
    fs.pipe_file(marker, writer().encode())


def end(url: str) -> None:
    """Rank 0, once the checkpoint at `url` is complete: remove the pending marker."""
    fs, marker = filesystem(pending_marker(url))
    with suppress(FileNotFoundError):
        fs.rm_file(marker)


def clear_sharded(url: str) -> None:
    """Remove a sharded checkpoint at `url` that a new one replaces: its `.metadata` first, so that
    whatever an interruption leaves behind is never taken for a checkpoint."""
    fs, key = filesystem(url)
    if not fs.exists(key):  # a new name: one request
        return
    with suppress(FileNotFoundError):
        fs.rm_file(join(key, METADATA_FILE))
    fs.rm(key, recursive=True)


def put_file(checkpoint: dict[str, Any], url: str) -> None:
    """`torch.save` of `checkpoint` uploaded to `url` in one call, with no commit of its own: for a
    file inside a sharded checkpoint, which its `.metadata` commits."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    fs, key = filesystem(url)
    fs.pipe_file(key, buffer.getvalue())


def save_file(checkpoint: dict[str, Any], url: str) -> None:
    """Write a one-file checkpoint to `url`: a pending marker, `torch.save` streamed to a
    temporary key beside it, a copy to `url`, then the marker removed.

    Where `url` holds a sharded checkpoint (saved under another strategy), it is removed once the
    upload is whole and before the copy, `.metadata` first (`clear_sharded`): a copy onto a folder
    would land inside it, and the store keeps no folder to rename aside. Until the copy, `load`
    says that the upload never finished, as while a sharded save replaces a checkpoint at a URL.
    """
    started = time.time()
    begin(url)
    fs, key = filesystem(url)
    temporary = _beside(key, f".{_name(key)}.{writer()}.{secrets.token_hex(4)}.tmp")
    try:
        with fs.open(temporary, "wb") as handle:
            torch.save(checkpoint, handle)
        if fs.isdir(key):
            clear_sharded(url)
            fs.invalidate_cache(key)
        fs.mv(temporary, key)
    except BaseException:
        with suppress(Exception):  # the store may be gone: the hidden key is never read as a checkpoint
            fs.rm_file(temporary)
        raise
    end(url)
    remove_stale_uploads(url, started)


def remove_stale_uploads(url: str, started: float) -> None:
    """Rank 0, once a one-file checkpoint at `url` committed: remove what interrupted uploads (a
    process killed, or a store gone, between its upload and the copy) left beside it.

    - Temporary keys of the same name, when the store last wrote them before the second in which
      this save `started`: one saver writes a name at a time, so nothing older is still being copied.
    - Temporary keys of other names whose writer (`HOST-PID` in the key) is a process of this host
      that no longer runs, and those names' pending markers: that upload can never finish (a job
      saving `step-N` names never saves an interrupted name again).
    - Pending markers of other names whose writer (`HOST-PID`, the marker's content) is a process
      of this host that no longer runs: an upload that failed before its temporary key existed (the
      store gone mid-save) leaves only its marker.

    Another host's keys and markers of other names are left: whether their writer still runs
    cannot be told from here. Failing to list or delete only leaves them (the checkpoint is
    committed already)."""
    fs, key = filesystem(url)
    folder = key.rstrip("/").rpartition("/")[0]
    try:
        entries = fs.ls(folder, detail=True)
    except Exception:
        return
    for entry in entries:
        with suppress(Exception):  # one entry gone meanwhile (removed with its key) skips only that entry
            _remove_if_stale(fs, folder, entry["name"], _name(key), started)


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<writer>[^.]+-\d+)\.[0-9a-f]{8}\.tmp")
_MARKER = re.compile(rf"\.(?P<name>.+){re.escape(PENDING_SUFFIX)}")


def _remove_if_stale(fs: AbstractFileSystem, folder: str, path: str, saved: str, started: float) -> None:
    if (found := _TEMPORARY.fullmatch(_name(path))) is not None:
        if found["name"] == saved:
            stale = fs.modified(path).timestamp() < int(started)
        else:
            stale = _dead_writer_of_this_host(found["writer"])
        if stale:
            fs.rm_file(path)
            if found["name"] != saved:
                with suppress(FileNotFoundError):
                    fs.rm_file(f"{folder}/.{found['name']}{PENDING_SUFFIX}")
    elif (found := _MARKER.fullmatch(_name(path))) is not None and found["name"] != saved:
        if _dead_writer_of_this_host(fs.cat_file(path).decode(errors="replace")):
            with suppress(FileNotFoundError):
                fs.rm_file(path)


def _dead_writer_of_this_host(name: str) -> bool:
    """Whether `name` (`HOST-PID`, see `writer`) is another process of this host that no longer runs."""
    host, _, pid = name.strip().rpartition("-")
    return host == _host() and pid.isdigit() and int(pid) != os.getpid() and not running(int(pid))


# -- reading -------------------------------------------------------------------------------------
def load_file(url: str, weights_only: bool) -> dict[str, Any]:
    """`torch.load` of the one-file checkpoint at `url`, read whole into memory first."""
    fs, key = filesystem(url)
    try:
        data = fs.cat_file(key)
    except (FileNotFoundError, IsADirectoryError) as err:
        require_complete(url)
        raise missing(url) from err
    except Exception as err:
        raise unreachable(url, "Reading", err) from err
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def require_complete(url: str) -> None:
    """Raise when `url` holds an unfinished upload: a sharded directory without `.metadata`, or
    nothing but a pending marker beside it. A complete checkpoint or nothing at all passes."""
    fs, key = filesystem(url)
    try:
        if fs.isfile(key) or fs.isfile(join(key, METADATA_FILE)):
            return
        unfinished = fs.isdir(key) or fs.exists(filesystem(pending_marker(url))[1])
    except Exception as err:
        raise unreachable(url, "Reading", err) from err
    if unfinished:
        raise CheckpointError(
            f"The upload of the checkpoint '{url}' never finished (no commit marker): load the previous"
            " checkpoint instead, such as the one that lite_core.checkpoint.latest() finds under its prefix."
        )


def missing(url: str) -> CheckpointError:
    """One sentence for a URL where nothing is, naming a missing bucket (the first part of the path)."""
    fs, key = filesystem(url)
    bucket = key.strip("/").split("/", 1)[0]
    try:
        gone = bool(bucket) and bucket != key.strip("/") and not fs.exists(bucket)
    except Exception:  # the question is only to word the message better
        gone = False
    if gone:
        return CheckpointError(f"No checkpoint at '{url}' because its bucket '{bucket}' does not exist: create"
                               " the bucket or correct the URL you passed to load().")
    return CheckpointError(f"No checkpoint at '{url}': check the URL you passed to load().")


def unreachable(url: str, doing: str, err: Exception) -> CheckpointError:
    """One sentence for a store that refused or could not be reached."""
    return CheckpointError(f"{doing} '{url}' failed with {describe(err)}: {store_hint(err)}.")


def store_hint(err: BaseException) -> str:
    """What to fix when a store call failed with `err` (the end of a sentence)."""
    if isinstance(err, PermissionError):
        return ("check the credentials the store gets (its environment variables, such as AWS_ACCESS_KEY_ID,"
                " or fsspec's storage options)")
    if isinstance(err, FileNotFoundError):
        return "create the bucket or correct the URL"
    return "check the store's endpoint (such as AWS_ENDPOINT_URL) and that this machine can reach it"


def describe(error: BaseException) -> str:
    message = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__} ({message})" if message else type(error).__name__
