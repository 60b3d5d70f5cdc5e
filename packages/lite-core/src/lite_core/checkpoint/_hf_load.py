"""Hugging Face safetensors files (what `transformers`' `save_pretrained` writes, or
`LightningLite.export_safetensors`) loaded into a set-up model by torch distributed checkpoint's
`HuggingFaceStorageReader`: each process reads only the slices of the files that its own shards
hold, so under a sharded strategy no process holds the whole model."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from torch import nn

from lite_core.checkpoint._export import INDEX_FILE, tied_names
from lite_core.errors import CheckpointError

#: The one file of a model small enough not to be split (`transformers` writes no index then).
SINGLE_FILE = "model.safetensors"


def read_safetensors(module: nn.Module, folder: str) -> None:
    """Load every weight of `module` (a set-up model's own module: plain, DDP, FSDP2 or tensor
    parallel) from the safetensors files in the local `folder`, on every process at once.

    A weight tied to an earlier one (a language model's head) is not read: it is the same tensor.
    The files may hold weights the module lacks; a weight of the module that they lack is refused
    before anything is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    tied = tied_names(module)
    state: dict[str, Any] = {name: value for name, value in get_model_state_dict(module).items() if name not in tied}
    _require_every_weight(folder, state, module)
    with warnings.catch_warnings():  # one process loads on purpose where no process group runs
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))


def _require_every_weight(folder: str, state: dict[str, Any], module: nn.Module) -> None:
    held = weight_names(folder)
    missing = [name for name in state if name not in held]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:3])
        raise CheckpointError(
            f"The safetensors files in '{folder}' hold no weight for {len(missing)} of the {len(state)} weights"
            f" of {type(module).__name__}, such as {shown}: load files saved from the same model class and"
            " configuration."
        )


def weight_names(folder: str) -> set[str]:
    """The names of the weights the safetensors files in `folder` hold: from the index
    (`model.safetensors.index.json`), or from the one file (`model.safetensors`)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return set(json.load(handle)["weight_map"])
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        raise CheckpointError(f"No safetensors model in '{folder}' (neither {INDEX_FILE} nor {SINGLE_FILE}):"
                              " pass the folder that save_pretrained or export_safetensors wrote.")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return set(handle.keys())
