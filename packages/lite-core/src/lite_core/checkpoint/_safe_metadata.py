"""Reading a sharded checkpoint's `.metadata` without running code from it.

Torch distributed checkpoint's readers load `.metadata` with a plain `pickle.load`, which calls
whatever a pickle names: a checkpoint from a shared bucket could run a command on the reader's
machine. Lite reads it instead with an unpickler that knows only what torch writes there: DCP's
own metadata classes (`torch.distributed.checkpoint.metadata` and `filesystem._StorageInfo`),
torch's dtypes, layouts, memory formats and `Size`, and the path the checkpoint was saved to.
Anything else is refused before it is called. The tensors themselves are read by DCP with
`torch.load(weights_only=True)` already.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import pathlib
import pickle
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lite_core.errors import CheckpointError


def refuse_code_in_metadata(reader: Any, where: str) -> Any:
    """`reader` (DCP's `FileSystemReader` or `FsspecReader`), made to read `.metadata` with the
    restricted unpickler; a pickle that names anything else raises a `CheckpointError`."""
    reader.read_metadata = functools.partial(_read_metadata, reader, where)
    return reader


def _read_metadata(reader: Any, where: str, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
    # The same steps as torch's `read_metadata`, with the unpickler swapped.
    path = reader._get_metadata_path(kwargs.get("rank"))
    with reader.fs.create_stream(path, "rb") as stream:
        metadata = load(stream, where)
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def load(stream: IO[bytes], where: str) -> dcp_metadata.Metadata:
    """The `Metadata` pickled in `stream`, read by the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except _RefusedGlobal as refused:
        raise CheckpointError(
            f"The sharded checkpoint '{where}' has a '.metadata' that names {refused}, which torch"
            " distributed checkpoint never writes there, so it was not loaded (it could run code):"
            " if you trust the checkpoint, call load(..., weights_only=False)."
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(
            f"The sharded checkpoint '{where}' has a '.metadata' that holds a {type(metadata).__name__},"
            " not torch distributed checkpoint's metadata: point load() at a checkpoint that Lite saved."
        )
    return metadata


class _RefusedGlobal(pickle.UnpicklingError):
    """A global that the metadata unpickler does not allow (its text names it)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is None:
            found = _torch_constant(module, name)
        if found is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"a persistent id ({type(pid).__name__})")


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """The classes and functions `.metadata` may name, by (module, name) as pickle spells them."""
    classes: list[Any] = [
        value for value in vars(dcp_metadata).values()
        if inspect.isclass(value) and value.__module__ == dcp_metadata.__name__
        and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    ]
    classes += [_StorageInfo, torch.Size, collections.OrderedDict]
    allowed = {(cls.__module__, cls.__qualname__): cls for cls in classes}
    for path_class in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", path_class.__name__)] = path_class  # where the checkpoint was saved
        allowed[(path_class.__module__, path_class.__name__)] = path_class
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("builtins", "getattr")] = enum_getattr(_enums(classes), _RefusedGlobal)  # members of these enums only
    return allowed


def _torch_constant(module: str, name: str) -> torch.dtype | torch.memory_format | None:
    """`torch.float32`, `torch.contiguous_format` and the like; nothing else of torch's namespace."""
    if module != "torch":
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.memory_format)) else None


def _layout(name: str) -> torch.layout:
    layouts = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
    if name not in layouts:
        raise _RefusedGlobal(f"an unknown layout {name!r}")
    return layouts[name]


def enum_getattr(enums: Iterable[type[enum.Enum]],
                 error: Callable[[str], Exception] = pickle.UnpicklingError) -> Callable[[Any, str], enum.Enum]:
    """A stand-in for `getattr` in a restricted unpickler's allowed globals: an `Enum` member
    pickles as `getattr(TheEnum, "NAME")`, so an unpickler that allows enums must allow `getattr`,
    and this one returns members of `enums` and nothing else (raising `error` with what was asked)."""
    allowed = frozenset(enums)

    def member(owner: Any, name: str) -> enum.Enum:
        if owner not in allowed or not isinstance(name, str) or name not in owner.__members__:
            raise error(f"getattr({owner!r}, {name!r})")
        return owner.__members__[name]

    return member


def _enums(classes: Iterable[Any]) -> list[type[enum.Enum]]:
    return [cls for cls in classes if inspect.isclass(cls) and issubclass(cls, enum.Enum)]
