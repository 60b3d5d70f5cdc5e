"""`latest`: the latest complete checkpoint under a prefix, in any store (`lite_core.checkpoint.stores`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from lite_core.checkpoint import _store
from lite_core.checkpoint.stores import as_local, store_for

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def latest(prefix: str) -> str | None:
    """The latest complete checkpoint directly under `prefix` (a local folder, an fsspec URL, or a
    path of a registered store), or `None` when there is none.

    Complete means: a sharded checkpoint directory with its `.metadata` (torch writes it last), or
    a one-file checkpoint written by `torch.save` (a temporary file or key, whose name starts with
    a dot, is never one). Unfinished uploads, other files (logs, metrics) and hidden names are
    passed over. The latest is the one committed last (the time of its `.metadata`, or of the
    file), names in natural order ("step-9" before "step-10") breaking ties.

    Example:
        >>> path = latest("s3://bucket/run1")  # doctest: +SKIP
        >>> state = self.load(path, state) if path else {}  # doctest: +SKIP
    """
    prefix = as_local(prefix)
    store = store_for(prefix)
    fs, folder = store.filesystem(prefix)
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return None
    except Exception as err:
        raise _store.unreachable(prefix, "Listing", err) from err
    found = [(when, _natural(name), name) for name, when in _complete(fs, entries)]
    if not found:
        return None
    return store.join(prefix, max(found)[2])


def _complete(fs: AbstractFileSystem, entries: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, commit time) of each complete checkpoint among `entries`."""
    complete = []
    for entry in entries:
        path = entry["name"].rstrip("/")
        name = path.rpartition("/")[2]
        if name.startswith("."):
            continue
        try:
            if entry["type"] == "directory":
                when = fs.modified(_store.join(path, _store.METADATA_FILE))
            elif _written_by_torch(fs, path):
                when = fs.modified(path)
            else:
                continue
        except FileNotFoundError:  # a directory without `.metadata`: an unfinished upload
            continue
        complete.append((name, when.timestamp()))
    return complete


def _written_by_torch(fs: AbstractFileSystem, path: str) -> bool:
    """Whether the file at `path` starts as `torch.save` files do (a zip archive)."""
    with fs.open(path, "rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def _natural(name: str) -> list[Any]:
    """`name` split into text and numbers, so that "step-9" sorts before "step-10"."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]
