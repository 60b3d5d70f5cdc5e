"""Sharded checkpoint directories: recognising them, reading them whole in one process, and
turning them into one file (the formats are described in `lite_core.checkpoint`)."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from lite_core.checkpoint._store import EXTRA_FILE, METADATA_FILE
from lite_core.checkpoint.stores import Store, store_for
from lite_core.errors import CheckpointError

__all__ = ["EXTRA_FILE", "consolidate", "is_sharded", "read_sharded"]


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether `path` (a local path or an fsspec URL) is a sharded (directory) checkpoint written by Lite."""
    store = store_for(path)
    return store.is_file(store.join(os.fspath(path), METADATA_FILE))


def storage_reader(path: str, weights_only: bool = True, store: Store | None = None) -> Any:
    """Torch distributed checkpoint's reader for `path` (`FsspecReader` for a URL: the reader of
    `store`, by default the path's); with `weights_only`, its `.metadata` is read without running
    code (see `_safe_metadata`)."""
    reader = (store or store_for(path)).shard_reader(path)
    if not weights_only:
        return reader
    from lite_core.checkpoint._safe_metadata import refuse_code_in_metadata

    return refuse_code_in_metadata(reader, path)


def reading_metadata_once(reader: Any) -> Any:
    """`reader`, whose `.metadata` is read on the first `read_metadata()` only: Lite's checks
    and torch's loading both ask for it (at a URL, two requests each time)."""
    reader.read_metadata = functools.cache(reader.read_metadata)
    return reader


def consolidate(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """Turn the sharded checkpoint directory `source` into one file that `torch.load` reads.

    Runs in one process, without a process group; it needs memory for the whole checkpoint.
    The file is written atomically and holds the same keys the checkpoint was saved with
    (modules as full state dicts, optimizers with state keyed by parameter name).

    Args:
        source: a directory written by `save` under `strategy="fsdp"` or `"model_parallel"` (a
            local path or an fsspec URL).
        destination: the file to write (a local path or an fsspec URL).

    Example:
        >>> consolidate("checkpoints/step-100", "step-100.pt")  # doctest: +SKIP
        >>> torch.load("step-100.pt")["model"]["layer.weight"]  # doctest: +SKIP
    """
    from lite_core.checkpoint._io import TorchCheckpointIO

    io = TorchCheckpointIO()
    io.save(read_sharded(source, io, weights_only=True), destination)


def read_sharded(path: str | os.PathLike[str], io: Any, weights_only: bool = True) -> dict[str, Any]:
    """The whole content of a sharded checkpoint as full tensors, read in this process alone."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not is_sharded(path):
        raise CheckpointError(f"'{path}' is not a sharded checkpoint directory: pass a directory saved under strategy='fsdp'.")
    tensors: dict[str, Any] = {}
    reader = reading_metadata_once(storage_reader(os.fspath(path), weights_only))
    try:
        reader.read_metadata()  # first, so that a refusal to unpickle it is raised as it is, not wrapped by torch
        _load_state_dict(tensors, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's own exception is a BaseException
        raise read_failure(path, err) from err
    store = store_for(path)
    extra = store.join(os.fspath(path), EXTRA_FILE)
    return {**io.load(extra, weights_only=weights_only), **tensors}



def read_failure(path: str | os.PathLike[str], error: BaseException) -> CheckpointError:
    """What reading the shards of `path` failed with, in one sentence: a refusal of safe loading
    (a pickled class the checkpoint names) as a refusal, naming the class; anything else as damage."""
    import pickle

    from lite_core.checkpoint._rank_zero import first_failure

    cause = first_failure(error)[1]
    text = " ".join(str(cause).split())
    refused = re.search(r"unsupported global:? (?:GLOBAL )?(\S+)", text, flags=re.IGNORECASE)
    if isinstance(cause, pickle.UnpicklingError) and refused is not None:
        return CheckpointError(
            f"The sharded checkpoint '{path}' holds pickled {refused.group(1)} objects, which torch's safe"
            " loading of shards refuses: save it again with a Lite that writes plain tensors, or read it in"
            " a process that imports and allow-lists that class (torch.serialization.add_safe_globals)."
        )
    return CheckpointError(
        f"The sharded checkpoint '{path}' is incomplete or damaged ({type(error).__name__}): point"
        " load() at a complete checkpoint."
    )
