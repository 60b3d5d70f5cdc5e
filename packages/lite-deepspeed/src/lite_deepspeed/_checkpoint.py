"""DeepSpeed checkpoint directories that also hold the user's other state."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from lite_core.plugins import (
    CheckpointError,
    MisuseError,
    READER_FILE,
    TrainableState,
    check_weights_fit,
    commit_folder,
    forward_module,
    is_set_up,
    is_sharded,
    on_rank_zero,
    restore,
    staging_folder,
    to_state,
    unwrap_optimizer,
)
from lite_deepspeed import _portable
from lite_deepspeed._safe import refuse_code
from lite_deepspeed.optimizer import DeepSpeedEngineOptimizer


class DeepSpeedRun(Protocol):
    """What this module reads of the `DeepSpeedStrategy` that calls it (which hands itself down:
    the strategy imports this module, never the other way round)."""

    world_size: int
    global_rank: int
    stage: int
    accelerator: Any

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any: ...

    def batch_to_device(self, batch: Any) -> Any: ...


#: Key of the client state that records which entries DeepSpeed itself saved.
_LAYOUT_KEY = _portable.LAYOUT_KEY

#: Keys that DeepSpeed's `save_checkpoint` writes beside the client state (read from
#: `DeepSpeedEngine._save_checkpoint`/`_common_checkpoint_state`/`_save_moe_checkpoint` and
#: `load_checkpoint` of DeepSpeed 0.19, plus older versions' `sparse_tensor_module_names` and
#: `zero_stage`): a client entry of the same name overwrites DeepSpeed's and breaks `load`.
RESERVED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "lr_scheduler", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "sparse_tensor_module_names", "data_sampler", "random_ltd",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "zero_stage",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_config", "ds_version", "num_experts",
    "ds_autoep_layers", "autoep_layers", "folding", _LAYOUT_KEY,
})


def find_engine(content: dict[str, Any]) -> tuple[str, Any] | None:
    """The one `(key, engine)` of a DeepSpeed model set up by Lite in `content`, if any: the model
    itself, or its trainable parameters (`trainable_state(model)`, an adapters-only checkpoint)."""
    from deepspeed import DeepSpeedEngine

    models = {key: value.module if isinstance(value, TrainableState) else value for key, value in content.items()}
    found = [(key, forward_module(model)) for key, model in models.items()
             if is_set_up(model) and isinstance(forward_module(model), DeepSpeedEngine)]
    if len(found) > 1:
        raise MisuseError(
            f"A DeepSpeed checkpoint holds one model but {[k for k, _ in found]} are DeepSpeed models: save"
            " each model to its own path."
        )
    return found[0] if found else None


def refuse_optimizer_alone(content: dict[str, Any]) -> None:
    """Refuse a save of a DeepSpeed optimizer without its model: its state lives in the engine's
    partitions, which only a save of the engine (the model, or its `trainable_state`) writes."""
    alone = [key for key, value in content.items() if isinstance(unwrap_optimizer(value), DeepSpeedEngineOptimizer)]
    if alone:
        raise MisuseError(
            f"save()'s content holds the DeepSpeed optimizer {alone[0]!r} without its model: add the model"
            " (or `trainable_state(model)` for an adapters-only checkpoint) to the same save."
        )


def _optimizer_keys(content: dict[str, Any], engine: Any) -> list[str]:
    keys = []
    for key, value in content.items():
        inner = unwrap_optimizer(value)
        if isinstance(inner, DeepSpeedEngineOptimizer) and inner.engine is engine:
            keys.append(key)
    return keys


def save(path: str, content: dict[str, Any], strategy: DeepSpeedRun, *, precision: Any) -> None:
    """Every rank writes its shards of the model and optimizer; the rest, and the state of
    `precision` (the job's), goes into the client state."""
    key, engine = find_engine(content)  # type: ignore[misc]
    optimizer_keys = _optimizer_keys(content, engine)
    rest = {k: v for k, v in content.items() if k != key and k not in optimizer_keys}
    refuse_reserved_keys(rest)
    client_state = to_state(rest, precision)
    trainable = content[key].names() if isinstance(content[key], TrainableState) else None
    client_state[_LAYOUT_KEY] = {"model": key, "optimizers": optimizer_keys, "saved": sorted(client_state),
                                 "trainable": trainable}
    started = time.time()
    # DeepSpeed's save is full of collectives: a rank that fails inside it leaves the others
    # waiting. What fails on one rank only (rank 0 makes the folder and pickles the client
    # state) is tried first, so that every rank raises instead.
    staging = on_rank_zero(strategy, path, lambda: _folder_to_write(Path(path), client_state))
    folder = staging or path
    # An adapters-only checkpoint: DeepSpeed leaves the frozen weights out of every file.
    engine.save_checkpoint(folder, client_state=client_state, exclude_frozen_parameters=trainable is not None)
    on_rank_zero(strategy, path, lambda: _finish(Path(folder), Path(path), staging is not None, started))


def _folder_to_write(path: Path, client_state: dict[str, Any]) -> str | None:
    """Check that DeepSpeed can save to `path`; where another strategy's checkpoint is there (one
    file, or a sharded folder), a staging folder beside it that replaces it once complete, as a
    save that changes the layout does under every strategy; None to write into `path` itself."""
    staging = None
    if path.is_file() or (path.is_dir() and is_sharded(str(path)) and not is_deepspeed_directory(str(path))):
        staging = staging_folder(path)
    _check_can_save(Path(staging or path), client_state)
    return staging


def _finish(folder: Path, path: Path, staged: bool, started: float) -> None:
    # Names the strategy that reads this directory whole, so that every strategy loads it.
    (folder / READER_FILE).write_text("deepspeed\n")
    if staged:
        commit_folder(folder, path, started)


def _check_can_save(path: Path, client_state: dict[str, Any]) -> None:
    """Make the folder `path` and check that it is writable and that `client_state` pickles (its
    tensors' data aside, which always does), as DeepSpeed's rank 0 will need."""
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"'{path}' is not writable")
    _TensorsAside(_Discard(), protocol=2).dump(client_state)  # the protocol torch.save uses


class _Discard:
    """A file that forgets what is written to it."""

    def write(self, data: bytes) -> int:
        return len(data)


class _TensorsAside(pickle.Pickler):
    """Pickles everything but tensors and storages, which it leaves out."""

    def persistent_id(self, obj: Any) -> str | None:
        return "tensor" if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


def refuse_reserved_keys(rest: dict[str, Any]) -> None:
    """Refuse entries saved beside the model and optimizer whose key DeepSpeed uses itself."""
    taken = sorted(key for key in rest if key in RESERVED_KEYS)
    if taken:
        raise MisuseError(
            f"The key {taken[0]!r} in save()'s content is one DeepSpeed uses in its own checkpoint: rename it"
            f" (e.g. 'my_{taken[0]}'), or, for an optimizer, pass the one setup(model, optimizer) returned."
        )


def load(path: str, state: dict[str, Any], strict: bool, strategy: DeepSpeedRun,
         weights_only: bool = True, *, precision: Any) -> dict[str, Any]:
    """Restore the model (and optimizer, if `state` holds it) from the DeepSpeed checkpoint
    directory `path`, then the rest: through DeepSpeed when it can read the shards as they are
    (same ZeRO layout and number of ranks), else by reading the checkpoint whole. With
    `weights_only`, files that name anything but DeepSpeed's own classes are refused first."""
    key, engine = find_engine(state)  # type: ignore[misc]
    saved = _latest_tag_dir(Path(path))
    if saved is None or not _deepspeed_reads_as_is(saved, strategy, precision.name):
        return load_whole(_portable.read_whole(path, weights_only), state, strict, strategy, precision=precision)
    if weights_only:
        refuse_code(saved, path)
    # DeepSpeed's own load names a weight of another shape in torch's raw lists. Shapes only: the
    # saved shapes of ZeRO 1-3 cover the trained parameters, not buffers or frozen weights.
    expected = _portable.whole_shapes(engine.module)
    check_weights_fit(engine.module, expected, _portable.saved_shapes(saved), strict=False)
    optimizer_keys = _optimizer_keys(state, engine)
    trainable = isinstance(state[key], TrainableState)
    if trainable and _portable.trainable_names(saved) is None:  # the whole model saved: read it whole
        return load_whole(_portable.read_whole(path, weights_only), state, strict, strategy, precision=precision)
    if trainable and strict:
        state[key].check_names(_portable.trainable_names(saved) or [])
    load_path, client_state = engine.load_checkpoint(
        path, load_module_strict=strict and not trainable, load_optimizer_states=bool(optimizer_keys),
        load_lr_scheduler_states=False,
    )
    if load_path is None:
        raise CheckpointError(f"'{path}' holds no DeepSpeed checkpoint: point load() at a directory written by save().")
    # DeepSpeed returns its own bookkeeping too: keep what Lite saved.
    saved_keys = (client_state or {}).get(_LAYOUT_KEY, {}).get("saved", [])
    client_state = {k: client_state[k] for k in saved_keys}
    rest = {k: v for k, v in state.items() if k != key and k not in optimizer_keys}
    restore(rest, client_state, strict=strict, precision=precision)
    state.update(rest)
    return client_state


def load_whole(content: dict[str, Any], state: dict[str, Any], strict: bool, strategy: DeepSpeedRun, *,
               precision: Any) -> dict[str, Any]:
    """Restore `state` from whole `content` (a one-file, fsdp or other-layout ZeRO checkpoint):
    the DeepSpeed model and its optimizer by scattering full tensors into the shards, the rest as
    the core does; returns the content other than the model and optimizer."""
    key, engine = find_engine(state)  # type: ignore[misc]
    optimizer_keys = _optimizer_keys(state, engine)
    missing = [k for k in (key, *optimizer_keys) if k not in content]
    if strict and missing:
        raise CheckpointError(f"The checkpoint has no entry for {missing}: save them too, or load with strict=False.")
    optimizer_state = next((content[k] for k in optimizer_keys if k in content), None)
    if optimizer_state is not None and not _keyed_by_name(optimizer_state):
        optimizer_state = _positions_to_names(optimizer_state, engine)
    model_state = content.get(key, {})
    if isinstance(state[key], TrainableState):  # only the trainable weights: the others stay
        if strict:
            state[key].check_names(list(model_state))
        _portable.load_whole(engine, model_state, optimizer_state, strict=False)
    else:
        _portable.load_whole(engine, model_state, optimizer_state, strict)
    others = {k: v for k, v in content.items() if k != key and k not in optimizer_keys}
    rest = {k: v for k, v in state.items() if k != key and k not in optimizer_keys}
    restore(rest, others, strict=strict, precision=precision)
    state.update(rest)
    return others


def _deepspeed_reads_as_is(saved: Path, strategy: DeepSpeedRun, precision_name: str) -> bool:
    """Whether DeepSpeed's own `load_checkpoint` restores the save in `saved` correctly here."""
    shards = list(saved.glob("*zero_pp_rank_*_optim_states.pt"))
    if shards and len(shards) != strategy.world_size:
        return False
    saved_3 = _saved_stage_3(saved)
    if saved_3 is not None and saved_3 != (strategy.stage == 3):
        return False
    if not shards and strategy.stage > 0:  # saved without ZeRO, loaded with it
        return False
    # Measured with DeepSpeed 0.19.8 on the CPU accelerator: ZeRO-3 in bf16 restores the fp32
    # shards into the bf16 parameters byte for byte, i.e. garbage weights, without an error.
    assert strategy.accelerator is not None
    return not (strategy.stage == 3 and strategy.accelerator.name == "cpu" and precision_name.startswith("bf16"))


def _keyed_by_name(optimizer_state: Any) -> bool:
    groups = optimizer_state.get("param_groups") or [] if isinstance(optimizer_state, dict) else []
    return any(isinstance(p, str) for group in groups for p in group.get("params", []))


def _positions_to_names(optimizer_state: dict[str, Any], engine: Any) -> dict[str, Any]:
    """A torch optimizer's state dict (parameters numbered in the optimizer's order) keyed by
    parameter name; DeepSpeed's optimizer keeps the parameters of each group in that order."""
    names = _names_in_optimizer_order(engine)
    positions = [p for group in optimizer_state["param_groups"] for p in group["params"]]
    if len(positions) != len(names):
        raise CheckpointError(
            f"The checkpoint's optimizer holds {len(positions)} parameters but this model trains {len(names)}:"
            " load the checkpoint into the model and optimizer it was saved from."
        )
    by_position = dict(zip(positions, names))
    return {"state": {by_position[p]: v for p, v in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [by_position[p] for p in g["params"]]}
                             for g in optimizer_state["param_groups"]]}


def _names_in_optimizer_order(engine: Any) -> list[str]:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = getattr(engine.optimizer, "bit16_groups", None) or getattr(engine.optimizer, "fp16_groups", None)
    if groups is None:  # no ZeRO: the user's optimizer, over the model's parameters
        groups = [g["params"] for g in engine.optimizer.param_groups]
    return [names[id(p)] for group in groups for p in group]


def is_deepspeed_directory(path: str) -> bool:
    """Whether `path` is a checkpoint directory that DeepSpeed wrote (it has DeepSpeed's `latest` file)."""
    return (Path(path) / "latest").is_file()


def _saved_stage_3(directory: Path) -> bool | None:
    """Whether the checkpoint in `directory` was written under ZeRO-3 (its model states are
    sharded per rank); None if the files do not say."""
    names = [p.name for p in directory.glob("*model_states.pt")]
    if not names:
        return None
    return all(name.startswith("zero_pp_rank_") for name in names)


def _latest_tag_dir(path: Path) -> Path | None:
    """The folder of the newest save in the DeepSpeed checkpoint `path` (named by its `latest`
    file), or None when there is no `latest` file."""
    latest = path / "latest"
    return path / latest.read_text().strip() if latest.is_file() else None


