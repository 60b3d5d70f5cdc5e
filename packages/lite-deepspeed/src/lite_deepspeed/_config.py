"""The DeepSpeed configuration: built from keyword options or read from the user, then completed.

Everything here works on plain dicts and imports no DeepSpeed code, except `validate_sections`,
which lets DeepSpeed's own models check the values of the sections it validates.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

import torch

from lite_core.plugins import ConfigurationError, precision_entry

#: Top-level keys of a DeepSpeed config (sections and scalars) that a typo is checked against.
_KNOWN_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast", "zero_optimization",
    "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "communication_data_type", "seq_parallel_communication_data_type", "steps_per_print",
    "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "activation_checkpointing", "flops_profiler", "autotuning",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "checkpoint", "aio",
    "elasticity", "data_efficiency", "curriculum_learning", "compression_training",
    "sparse_attention", "pipeline", "data_types", "dataloader_drop_last", "disable_allgather",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "weight_quantization",
    "hybrid_engine", "compile", "timers", "use_data_before_expert_parallelism",
    "managed_gradient_accumulation", "gradient_allreduce_op", "tensor_parallel", "log_level",
    "disable_python_gc", "graph_harvesting", "nebula", "vocabulary_size",
})
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DEFAULT_BUCKET = 200_000_000


def zero_config(stage: int, offload_optimizer: bool, offload_parameters: bool, *,
                allgather_bucket_size: int = _DEFAULT_BUCKET, reduce_bucket_size: int = _DEFAULT_BUCKET,
                overlap_comm: bool = True, contiguous_gradients: bool = True,
                pin_memory: bool = False) -> dict[str, Any]:
    """The config that the keyword options of `DeepSpeedStrategy` describe."""
    if stage not in (0, 1, 2, 3):
        raise ConfigurationError(f"stage={stage!r} is not a ZeRO stage: pass 0, 1, 2 or 3.")
    if offload_optimizer and stage < 2 or offload_parameters and stage < 3:
        raise ConfigurationError(
            f"stage={stage} cannot offload {'parameters' if offload_parameters else 'the optimizer'}:"
            " optimizer offload needs stage 2 or 3 and parameter offload stage 3."
        )
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": overlap_comm,
        "contiguous_gradients": contiguous_gradients,
        "reduce_bucket_size": reduce_bucket_size,
    }
    if stage in (1, 2):
        zero["allgather_bucket_size"] = allgather_bucket_size
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {"zero_optimization": zero}


def with_lite_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` behaving like the user's plain loop, for every key the config leaves out.

    Lite users pass their own optimizer instance, which DeepSpeed would refuse under ZeRO unless
    it is one it tested, and would replace by its own JIT-compiled CPU Adam when offloading; and
    DeepSpeed clips gradients to norm 1.0 unless told otherwise, while Lite clips only when the
    user calls `clip_gradients`.
    """
    defaults = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                "gradient_clipping": 0.0}
    return {**defaults, **config}


def read_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A deep copy of the user's config, read from JSON when it is a path."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(f"config={str(config)!r} is not a file: pass a dict or the path of a DeepSpeed JSON config.")
    try:
        loaded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigurationError(f"The DeepSpeed config '{path}' is not valid JSON ({err}): fix the file.") from err
    if not isinstance(loaded, dict):
        raise ConfigurationError(f"The DeepSpeed config '{path}' holds a {type(loaded).__name__}, not an object: fix the file.")
    return loaded


def check_keys(config: dict[str, Any]) -> None:
    """Refuse a top-level key that looks like a misspelt DeepSpeed key (DeepSpeed ignores them)."""
    for key in config:
        if key in _KNOWN_KEYS:
            continue
        guess = difflib.get_close_matches(key, sorted(_KNOWN_KEYS), n=1, cutoff=0.8)
        if guess:
            raise ConfigurationError(
                f"The DeepSpeed config key {key!r} is not one DeepSpeed reads: did you mean {guess[0]!r}?"
            )


def stage_of(config: dict[str, Any]) -> int:
    """The ZeRO stage the config asks for (0 without a `zero_optimization` section)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3):
        raise ConfigurationError(f"The DeepSpeed config sets zero_optimization.stage={stage!r}: use 0, 1, 2 or 3.")
    return int(stage)


def offloads_parameters(config: dict[str, Any]) -> bool:
    """Whether ZeRO-3 keeps the parameters on the CPU."""
    offload = (config.get("zero_optimization") or {}).get("offload_param") or {}
    return offload.get("device", "none") not in ("none", None)


#: The DeepSpeed config section each Lite precision turns on.
#: DeepSpeed's config section for the dtype a precision's row names (float32: none).
DTYPE_SECTIONS: dict[torch.dtype, str | None] = {torch.float32: None, torch.float16: "fp16", torch.bfloat16: "bf16"}


def with_precision(config: dict[str, Any], precision: str) -> dict[str, Any]:
    """`config` with the fp16/bf16 section that `precision` needs; a contradicting one is refused."""
    wanted = DTYPE_SECTIONS[precision_entry(precision).dtype]  # type: ignore[index]
    for section in ("fp16", "bf16"):
        enabled = bool((config.get(section) or {}).get("enabled", False))
        if enabled and section != wanted:
            raise ConfigurationError(
                f"The DeepSpeed config enables {section} but precision={precision!r}: set the precision"
                f" that matches the config, or remove the {section} section."
            )
    if wanted is not None:
        config = {**config, wanted: {**(config.get(wanted) or {}), "enabled": True}}
    return config


def has_batch_size(config: dict[str, Any]) -> bool:
    """Whether the user set a batch-size field."""
    return any(config.get(key) is not None for key in _BATCH_KEYS[:2])


def with_batch_size(config: dict[str, Any], micro_batch_size: int) -> dict[str, Any]:
    """`config` with `train_micro_batch_size_per_gpu`, unless the user set a batch size."""
    if has_batch_size(config):
        return config
    return {**config, "train_micro_batch_size_per_gpu": micro_batch_size}


def validate_sections(config: dict[str, Any]) -> None:
    """Let DeepSpeed's own models check the `zero_optimization` section (unknown keys, types)."""
    zero = config.get("zero_optimization")
    if zero is None:
        return
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as err:  # pydantic's ValidationError, without importing pydantic here
        details = " ".join(str(err).split())
        raise ConfigurationError(f"The DeepSpeed config's zero_optimization section is not valid ({details}): fix it.") from err
