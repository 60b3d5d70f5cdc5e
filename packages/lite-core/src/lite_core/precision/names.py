"""The precision names Lite accepts, and the legacy spellings it maps onto them."""

from __future__ import annotations

from typing import Any

from lite_core._suggest import closest
from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError

#: FP8 through torchao (`Float8Precision`): only accelerators that declare them run these.
FP8_PRECISIONS: frozenset[str] = frozenset({"fp8-tensorwise", "fp8-rowwise"})
#: Quantized frozen base weights through bitsandbytes (`QuantizedPrecision`, QLoRA): only strategies
#: that keep whole weights on each process run these.
QUANTIZED_PRECISIONS: frozenset[str] = frozenset({"nf4", "nf4-dq", "fp4", "fp4-dq", "int8"})
#: NF4 frozen base weights through torchao (`TorchaoNF4Precision`), a tensor subclass that FSDP2
#: shards: for the strategies that shard parameters with `fully_shard`.
SHARDED_QUANTIZED_PRECISIONS: frozenset[str] = frozenset({"nf4-torchao"})
PRECISIONS: frozenset[str] = frozenset(
    {"64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}
) | FP8_PRECISIONS | QUANTIZED_PRECISIONS | SHARDED_QUANTIZED_PRECISIONS

#: LightningLite 1.5's values: still accepted, with a `FutureWarning` naming the new value.
_LEGACY = {64: "64-true", 32: "32-true", 16: "16-mixed", "64": "64-true", "32": "32-true",
           "16": "16-mixed", "bf16": "bf16-mixed"}
#: What other libraries call a precision: only used to guess what a refused value meant.
_OTHER_SPELLINGS = {"fp16": "16-mixed", "float16": "16-mixed", "half": "16-mixed", "amp": "16-mixed",
                    "mixed": "16-mixed", "bfloat16": "bf16-mixed", "fp32": "32-true", "float32": "32-true",
                    "float": "32-true", "single": "32-true", "fp64": "64-true", "float64": "64-true",
                    "double": "64-true", "fp8": "fp8-rowwise", "float8": "fp8-rowwise"}


def normalize_precision(precision: Any) -> str:
    """Map `precision` (including the legacy 64/32/16/"bf16", with a warning) onto one of `PRECISIONS`."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    if isinstance(precision, (int, str)) and not isinstance(precision, bool) and precision in _LEGACY:
        name = _LEGACY[precision]
        # FutureWarning, not DeprecationWarning: Python shows it by default wherever the call is
        # (a DeprecationWarning only shows when triggered directly in __main__).
        warn_user(f"precision={precision!r} is deprecated: pass precision={name!r} instead.", FutureWarning)
        return name
    guess = _guess(precision)
    hint = f"did you mean {guess!r}? " if guess else ""
    raise ConfigurationError(
        f"precision={precision!r} is not supported: {hint}choose one of {sorted(PRECISIONS)}."
    )


def _guess(precision: Any) -> str | None:
    if not isinstance(precision, str):
        return None
    spellings = {**{name: name for name in PRECISIONS}, **{str(k): v for k, v in _LEGACY.items()}, **_OTHER_SPELLINGS}
    key = closest(precision.strip().lower(), spellings)
    return spellings[key] if key is not None else None


def unsupported_hint(name: str, by_strategy: bool = False) -> str:
    """What to add to the sentence refusing precision `name` on an accelerator without it (or, with
    `by_strategy`, under a strategy without it)."""
    if by_strategy and name in QUANTIZED_PRECISIONS:
        return (f"; {name!r} keeps whole quantized weights on each process, which a strategy that shards"
                " or copies parameters cannot carry: choose strategy='ddp' or 'single_device', or"
                " precision='nf4-torchao' (torchao's NF4, which fsdp and model_parallel shard)")
    if by_strategy and name in SHARDED_QUANTIZED_PRECISIONS:
        return (f"; {name!r} is torchao's NF4 for the strategies that shard parameters with FSDP2 (DDP's"
                " broadcast of the parameters corrupts its statistics): choose strategy='fsdp', 'model_parallel'"
                " or 'single_device', or precision='nf4' (bitsandbytes) under ddp")
    if by_strategy:
        return ""
    if name in FP8_PRECISIONS:
        recipe = name.removeprefix("fp8-")
        return (f", or emulate FP8 (slow; for tests and debugging) with"
                f" precision=Float8Precision({recipe!r}, emulate=True)")
    return ""
