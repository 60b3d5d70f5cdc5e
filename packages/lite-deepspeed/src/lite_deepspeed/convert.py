"""Turn a sharded DeepSpeed checkpoint directory into one full fp32 state dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lite_core.plugins import CheckpointError, TorchCheckpointIO


def convert_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str], output_file: str | os.PathLike[str],
                               tag: str | None = None) -> dict[str, Any]:
    """Gather the ZeRO shards of a checkpoint written by `lite.save()` into one fp32 state dict.

    The file at `output_file` (written atomically) loads into the plain, unwrapped model on one
    process: `model.load_state_dict(torch.load(output_file))`. Runs on one process, no GPU needed.

    Args:
        checkpoint_dir: the directory passed to `lite.save()` under a DeepSpeed strategy.
        output_file: where to write the state dict.
        tag: which checkpoint in the directory (default: the latest one).

    Returns:
        The state dict that was written.
    """
    directory = Path(checkpoint_dir)
    if not (directory / "latest").is_file() and (tag is None or not (directory / tag).is_dir()):
        raise CheckpointError(
            f"'{directory}' is not a DeepSpeed checkpoint directory: pass the directory that lite.save() wrote."
        )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    full = {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
    TorchCheckpointIO().save(full, output_file)
    return full
