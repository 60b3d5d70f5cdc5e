"""DeepSpeed checkpoint directories that also hold the user's other state."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lite_core.plugins import (
    CheckpointError,
    MisuseError,
    forward_module,
    is_set_up,
    restore,
    to_state,
    unwrap_optimizer,
)
from lite_deepspeed.optimizer import DeepSpeedEngineOptimizer

if TYPE_CHECKING:
    from lite_deepspeed.strategy import DeepSpeedStrategy

#: Key of the client state that records which entries DeepSpeed itself saved.
_LAYOUT_KEY = "lite_deepspeed"

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
    """The one `(key, engine)` of a DeepSpeed model set up by Lite in `content`, if any."""
    from deepspeed import DeepSpeedEngine

    found = [(key, forward_module(value)) for key, value in content.items()
             if is_set_up(value) and isinstance(forward_module(value), DeepSpeedEngine)]
    if len(found) > 1:
        raise MisuseError(
            f"A DeepSpeed checkpoint holds one model but {[k for k, _ in found]} are DeepSpeed models: save"
            " each model to its own path."
        )
    return found[0] if found else None


def _optimizer_keys(content: dict[str, Any], engine: Any) -> list[str]:
    keys = []
    for key, value in content.items():
        inner = unwrap_optimizer(value)
        if isinstance(inner, DeepSpeedEngineOptimizer) and inner.engine is engine:
            keys.append(key)
    return keys


def save(path: str, content: dict[str, Any], strategy: DeepSpeedStrategy) -> None:
    """Every rank writes its shards of the model and optimizer; the rest goes into the client state."""
    key, engine = find_engine(content)  # type: ignore[misc]
    optimizer_keys = _optimizer_keys(content, engine)
    rest = {k: v for k, v in content.items() if k != key and k not in optimizer_keys}
    refuse_reserved_keys(rest)
    client_state = to_state(rest, strategy)
    client_state[_LAYOUT_KEY] = {"model": key, "optimizers": optimizer_keys, "saved": sorted(client_state)}
    engine.save_checkpoint(path, client_state=client_state)


def refuse_reserved_keys(rest: dict[str, Any]) -> None:
    """Refuse entries saved beside the model and optimizer whose key DeepSpeed uses itself."""
    taken = sorted(key for key in rest if key in RESERVED_KEYS)
    if taken:
        raise MisuseError(
            f"The key {taken[0]!r} in save()'s content is one DeepSpeed uses in its own checkpoint: rename it"
            f" (e.g. 'my_{taken[0]}'), or, for an optimizer, pass the one setup(model, optimizer) returned."
        )


def load(path: str, state: dict[str, Any], strict: bool, strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """Restore the model (and optimizer, if `state` holds it) through DeepSpeed, then the rest."""
    found = find_engine(state)
    if found is None:
        raise CheckpointError(
            f"'{path}' is a DeepSpeed checkpoint, which loads into a set-up model: pass it in state,"
            " e.g. load(path, {'model': model, 'optimizer': optimizer})."
        )
    _refuse_known_corruption(strategy)
    saved = _latest_tag_dir(Path(path))
    if saved is not None:
        _check_world_size(path, saved, strategy.world_size)
        _check_stage(path, saved, strategy.stage)
    key, engine = found
    optimizer_keys = _optimizer_keys(state, engine)
    load_path, client_state = engine.load_checkpoint(
        path, load_module_strict=strict, load_optimizer_states=bool(optimizer_keys),
        load_lr_scheduler_states=False,
    )
    if load_path is None:
        raise CheckpointError(f"'{path}' holds no DeepSpeed checkpoint: point load() at a directory written by save().")
    # DeepSpeed returns its own bookkeeping too: keep what Lite saved.
    saved = (client_state or {}).get(_LAYOUT_KEY, {}).get("saved", [])
    client_state = {k: client_state[k] for k in saved}
    rest = {k: v for k, v in state.items() if k != key and k not in optimizer_keys}
    restore(rest, client_state, strict=strict, strategy=strategy)
    state.update(rest)
    return client_state


def _refuse_known_corruption(strategy: DeepSpeedStrategy) -> None:
    # Measured with DeepSpeed 0.19.8 on the CPU accelerator: ZeRO-3 in bf16 restores the fp32
    # shards into the bf16 parameters byte for byte, i.e. garbage weights, without an error.
    assert strategy.accelerator is not None
    if strategy.stage == 3 and strategy.accelerator.name == "cpu" and strategy.precision.name.startswith("bf16"):
        raise CheckpointError(
            "DeepSpeed restores ZeRO-3 bf16 checkpoints on the CPU with corrupted weights: resume with"
            " precision='32-true', or load the converted full state dict (convert_to_fp32_state_dict) instead."
        )


def refuse_full_file(path: str, state: dict[str, Any]) -> None:
    """A one-file checkpoint (another strategy's) cannot resume a DeepSpeed model and optimizer."""
    if find_engine(state) is not None:
        raise CheckpointError(
            f"'{path}' is a one-file checkpoint, and a DeepSpeed model resumes only from a DeepSpeed"
            " checkpoint directory: resume it with the strategy that saved it, or load its weights"
            " into the model before setup (model.load_state_dict(torch.load(path)['model']))."
        )


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


def _check_stage(path: str, saved: Path, stage: int) -> None:
    """Refuse, before DeepSpeed reads anything, a checkpoint of ZeRO-3 under stage 1/2 or back."""
    saved_3 = _saved_stage_3(saved)
    if saved_3 is not None and saved_3 != (stage == 3):
        saved = "ZeRO stage 3" if saved_3 else "ZeRO stage 1 or 2"
        raise CheckpointError(
            f"'{path}' was saved under {saved} but this strategy uses stage {stage}: resume with the stage"
            " that saved it, or convert it with convert_to_fp32_state_dict and load that."
        )


def _check_world_size(path: str, saved: Path, world_size: int) -> None:
    """Refuse, before DeepSpeed reads anything, a checkpoint sharded over another number of ranks."""
    shards = list(saved.glob("*zero_pp_rank_*_optim_states.pt"))
    if shards and len(shards) != world_size:
        raise CheckpointError(
            f"'{path}' was saved by {len(shards)} processes but {world_size} are loading it: resume with the"
            " same number of processes, or convert it with convert_to_fp32_state_dict and load that."
        )
