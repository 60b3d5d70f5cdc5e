"""`xla_fsdp` checkpoints: one file of sharded state per replica, and their consolidation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from lite_core.plugins import CheckpointError, TorchCheckpointIO, forward_module

#: Marks a sharded module's entry: `{"state_dict": ..., "shard_metadata": ..., MARK: True}`.
MARK = "lite_xla_sharded_module"


def shard_file(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The file replica `rank` of `world_size` writes inside the checkpoint folder `path`."""
    return Path(path) / f"shard-{rank:05d}-of-{world_size:05d}.pt"


def sharded_entry(module: nn.Module) -> dict[str, Any] | None:
    """The entry saved for a model set up by `xla_fsdp`, or `None` for anything else."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    inner = forward_module(module)
    if not isinstance(inner, XlaFullyShardedDataParallel):
        return None
    return {"state_dict": inner.state_dict(), "shard_metadata": inner.get_shard_metadata(), MARK: True}


def whole_shapes(metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each weight's whole shape under the name `consolidate_checkpoint` gives it, read from
    torch-xla's shard metadata (`get_shard_metadata()`): the shards themselves are flat and padded,
    so two models whose weights have the same sizes in other shapes have shards alike."""
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, params in metadata.get("shard_info", {}).items():
        for info in params.values():
            name = f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]
            shapes[name] = tuple(info["_orig_size"])
    for flat, (names, flat_shapes, _) in metadata.get("flatten_info", {}).items():
        shapes.pop(flat, None)  # `flatten_parameters=True`: the weights it joined, each with its shape
        prefix = flat.rpartition(".")[0]
        shapes.update({f"{prefix}.{name}" if prefix else name: tuple(shape) for name, shape in zip(names, flat_shapes)})
    return {user_name(name): shape for name, shape in shapes.items()}


#: The parts of a name on torch-xla's FSDP wrapper that are the wrapper's, not the module's.
_WRAPPER_PARTS = frozenset({"_fsdp_shard", "_fsdp_wrapped_module", "_fpw_module"})


def user_name(name: str) -> str:
    """`_fsdp_wrapped_module._fpw_module.0._fsdp_shard_FSDP_SHARD_SEPARATOR_..._weight` -> `0.weight`."""
    parts = name.replace("_FSDP_SHARD_SEPARATOR_", ".").split(".")
    return ".".join(part for part in parts if part not in _WRAPPER_PARTS)


def consolidate_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Join the shards that `save` wrote under `xla_fsdp` into one checkpoint.

    Each sharded model becomes its full `state_dict` (the keys of the user's module); other
    entries are taken from replica 0's shard. Optimizer state stays sharded and is left out.

    Args:
        path: the folder passed to `LightningLite.save`.

    Returns:
        The consolidated content, ready for `torch.save` and for plain `load_state_dict`.
    """
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    shards = sorted(Path(path).glob("shard-*-of-*.pt"))
    if not shards:
        raise CheckpointError(f"{path} holds no xla_fsdp shards: pass the folder that save() wrote under xla_fsdp.")
    io = TorchCheckpointIO()
    contents = [io.load(str(shard), weights_only=True) for shard in shards]
    merged: dict[str, Any] = {}
    for key, value in contents[0].items():
        if isinstance(value, dict) and value.get(MARK):
            states = [content[key]["state_dict"] for content in contents]
            merged[key] = consolidate_sharded_state_dicts(states, value["shard_metadata"])
        elif not _is_optimizer_state(value):
            merged[key] = value
    return merged


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"state", "param_groups"}
