"""Checkpoints: how `LightningLite.save` and `load` write and read them, and the tools around them.

Lite writes two kinds of checkpoint, and `LightningLite.load` reads both under every strategy
and process count:

- **full**: one file written by `torch.save` (every strategy except `fsdp` by default, and
  `FSDPStrategy(state_dict_type="full")`). Modules are stored as their `state_dict()`.
- **sharded**: a directory written by `strategy="fsdp"`: the modules' and optimizers' tensors in
  torch distributed checkpoint format (one file per process plus `.metadata`), with every other
  value of the content that holds a `DTensor` (a dict or list of the user's own, such as an
  average of the sharded parameters), and the remaining values in `lite_extra.pt`. At `load`,
  such a value is read into the tensors the content passes for it: the same `DTensor`s in place,
  or whole tensors under another strategy.

Optimizer state saved by `fsdp` is keyed by parameter name (`"layer.weight"`) rather than by
position, so that it can be matched to parameters under any strategy.

A path keeps working when the strategy changes: a save replaces the checkpoint at its path
whatever its layout (a folder of shards by a file, or back), with the crash guarantees of a save
that replaces its own kind on a local disk (see `put_in_place`); at a URL the name holds no
checkpoint while a file replaces a folder (`_store.save_file`).

Where a checkpoint is kept is a `Store` (`stores`): `LocalStore` for local paths, `FsspecStore`
for fsspec URLs, or one registered for a URL protocol with `register_store`; `store_for(path)`
picks it, and every piece of checkpoint code goes through it. A sharded save to a file's name
(`final.pt`) warns once that it writes a folder.

Every piece of checkpoint code lives in this package: the byte-level IO plugins (`CheckpointIO`),
turning content into plain state and back (`to_state`, `restore`), the sharded format and
`consolidate`, `fsdp`'s own save and load, and the `lite consolidate` command.
"""

from __future__ import annotations

from lite_core.checkpoint._background import stage_to_host
from lite_core.checkpoint._io import CheckpointIO, TorchCheckpointIO
from lite_core.checkpoint._latest import latest
from lite_core.checkpoint._local import commit_folder, staging_folder
from lite_core.checkpoint._rank_zero import on_rank_zero, on_writing_ranks
from lite_core.checkpoint._safe_metadata import enum_getattr
from lite_core.checkpoint._sharded import EXTRA_FILE, consolidate, is_sharded, read_sharded
from lite_core.checkpoint._store import is_url
from lite_core.checkpoint.stores import FsspecStore, LocalStore, Store, register_store, store_for
from lite_core.checkpoint._trainable import TrainableState
from lite_core.checkpoint._state import (
    PRECISION_KEY,
    READER_FILE,
    check_weights_fit,
    read_checkpoint,
    restore,
    shapes_of,
    to_state,
)

__all__ = [
    "EXTRA_FILE",
    "FsspecStore",
    "LocalStore",
    "PRECISION_KEY",
    "READER_FILE",
    "Store",
    "CheckpointIO",
    "TorchCheckpointIO",
    "TrainableState",
    "check_weights_fit",
    "commit_folder",
    "consolidate",
    "enum_getattr",
    "is_sharded",
    "is_url",
    "latest",
    "on_rank_zero",
    "on_writing_ranks",
    "read_checkpoint",
    "read_sharded",
    "register_store",
    "restore",
    "shapes_of",
    "staging_folder",
    "stage_to_host",
    "store_for",
    "to_state",
]
