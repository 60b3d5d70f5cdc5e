"""TPUs and other XLA devices for Lite: `LightningLite(accelerator="tpu", devices=8)`.

Importing this package does not import torch-xla; that happens when a strategy first needs it.
"""

from __future__ import annotations

from typing import Any

from lite_xla.__about__ import __version__

__all__ = ["__version__", "consolidate_checkpoint"]


def consolidate_checkpoint(path: Any) -> dict[str, Any]:
    """Join the shards that `save` wrote under `strategy="xla_fsdp"` into one checkpoint (see
    `lite_xla._sharded_checkpoint.consolidate_checkpoint`)."""
    from lite_xla._sharded_checkpoint import consolidate_checkpoint as consolidate

    return consolidate(path)
