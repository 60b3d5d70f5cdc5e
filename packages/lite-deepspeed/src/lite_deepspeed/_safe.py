"""Loading a DeepSpeed checkpoint without running code from it.

DeepSpeed writes its checkpoint files with `torch.save` and reads them back with
`torch.load(..., weights_only=False)`, which calls whatever the pickles name. Before DeepSpeed (or
Lite's own whole-checkpoint reader) reads a folder, `refuse_code` loads every file of the save
with `torch.load(..., weights_only=True, mmap=True)` (the tensors' bytes are mapped, not read)
allowing only the classes DeepSpeed puts there: its loss scalers, `ZeroStageEnum` (whose members
pickle as `getattr(ZeroStageEnum, name)`, so `getattr` is allowed on that enum alone) and
`fragment_address`. A file that names anything else is refused with the `weights_only=False` way
out, as lite-core refuses any other checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from lite_core.plugins import CheckpointError, enum_getattr


def refuse_code(folder: Path, path: str) -> None:
    """Raise a `CheckpointError` if a file of the save in `folder` (of the checkpoint `path`) names
    anything beyond tensors and DeepSpeed's own bookkeeping classes."""
    with torch.serialization.safe_globals(_allowed()):
        for file in sorted(folder.glob("*.pt")):
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"The DeepSpeed checkpoint '{path}' holds in '{file.name}' pickled Python objects that"
                    " safe loading refuses (they could run code): if you trust the checkpoint, call"
                    " load(..., weights_only=False)."
                ) from err


def _allowed() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    enum_member = enum_getattr([ZeroStageEnum])
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address,
            (enum_member, "__builtin__.getattr"), (enum_member, "builtins.getattr")]
