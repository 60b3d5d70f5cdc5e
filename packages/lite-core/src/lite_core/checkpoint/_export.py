"""A trained model's weights as Hugging Face safetensors files, written by torch distributed
checkpoint's `HuggingFaceStorageWriter`: the files and index that `transformers`'
`from_pretrained` reads."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lite_core.checkpoint.stores import store_for

#: The files' size limit when the caller gives none: `transformers`' own default shard size.
DEFAULT_FILE_BYTES = 5 * 10**9
#: The index that names each tensor's file; `from_pretrained` reads it first.
INDEX_FILE = "model.safetensors.index.json"


def tied_names(module: torch.nn.Module) -> frozenset[str]:
    """The names under which `module` holds a parameter that it also holds under an earlier name
    (tied weights, such as a language model's head and its input embedding)."""
    first = {name for name, _ in module.named_parameters()}
    return frozenset(name for name, _ in module.named_parameters(remove_duplicate=False) if name not in first)


def export(state: dict[str, Any], path: str, max_file_bytes: int = DEFAULT_FILE_BYTES,
           tied: frozenset[str] = frozenset()) -> list[str]:
    """`write_safetensors` of `state` without the `tied` names into `path`, a local folder or an
    fsspec URL. For a URL the files are written into a local temporary folder and put into the
    store by its fsspec file system, the index last, so that a folder without its index is never
    taken for a whole export (`Store.write_folder`)."""
    state = {name: value for name, value in state.items() if name not in tied}
    return store_for(path).write_folder(path, lambda folder: write_safetensors(state, folder, max_file_bytes),
                                        last=INDEX_FILE)


def write_safetensors(state: dict[str, Any], folder: str, max_file_bytes: int = DEFAULT_FILE_BYTES) -> list[str]:
    """Write the tensors of `state` (a plain state dict, on one process) into `folder` as
    `model-0000i-of-0000N.safetensors` files of at most `max_file_bytes` each (a tensor larger
    than that gets a file of its own) and `model.safetensors.index.json`.

    A tensor that shares its storage with one written before it (tied weights, where the state
    holds them as one tensor) is left out, as `transformers` leaves it out: the model ties it again
    when it loads. Returns the names left out this way.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, tied = _untied(state)
    writer = HuggingFaceStorageWriter(folder, fqn_to_index_mapping=_files_by_size(tensors, max_file_bytes))
    with warnings.catch_warnings():  # one process writes on purpose; torch warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    return tied


def _untied(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of `state` whose storage no earlier tensor has, contiguous; and the others' names."""
    kept: dict[str, torch.Tensor] = {}
    tied: list[str] = []
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if view in seen:
            tied.append(name)
            continue
        seen.add(view)
        kept[name] = value.detach().contiguous()
    return kept, tied


def _files_by_size(tensors: dict[str, torch.Tensor], max_file_bytes: int) -> dict[str, int]:
    """Each tensor's file number (from 1), filling files in the state's order up to `max_file_bytes`."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping
