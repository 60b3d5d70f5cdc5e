"""Every precision Lite accepts, in one table, and the legacy spellings it maps onto them.

A row (`PrecisionEntry`) holds what the rest of Lite needs to know of a precision: its name, its
family, the dtype of its weights (`-true`) or of its autocast (`-mixed`), the dtype its matrix
products run in (for the throughput monitor's peak), the hardware it needs, and how its plugin is
built. Strategies and accelerators do not list names: they declare a `PrecisionSupport` (the
families, dtypes and hardware they carry), and their `supported_precisions` are the rows it
accepts. So a new precision is one row here (`register_precision`), and every strategy and
accelerator whose declaration fits it runs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from lite_core._suggest import closest
from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError
from lite_core.precision.fp8 import Float8Precision
from lite_core.precision.nf4 import TorchaoNF4Precision
from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision
from lite_core.precision.quantized import MODES, QuantizedPrecision

#: How a precision treats the model: its weights in one dtype (`true`), float32 weights under
#: autocast (`mixed`), torchao's FP8 matrix products (`fp8`), bitsandbytes' frozen quantized
#: weights, whole on each process (`quantized`), or torchao's NF4, which FSDP2 shards (`sharded-quantized`).
Family = Literal["true", "mixed", "fp8", "quantized", "sharded-quantized"]
FAMILIES: frozenset[str] = frozenset({"true", "mixed", "fp8", "quantized", "sharded-quantized"})


@dataclass(frozen=True)
class PrecisionEntry:
    """One precision: a row of the table.

    Attributes:
        name: what `LightningLite(precision=...)` takes.
        family: see `Family`.
        dtype: the weights' dtype (`true`) or the autocast dtype (`mixed`); `None` for the others.
        matmul: the dtype the matrix products run in, as `ThroughputMonitor`'s peak table names it
            (`"bf16"`, `"fp8"`, ...); `None` where torch's float32 matmul setting decides (fp32 or tf32).
        needs: the hardware features it needs (`"fp8"`: FP8 matrix units), which an accelerator
            declares in its `PrecisionSupport.hardware`.
        build: `(name, device_type) -> Precision`, the core's plugin for it.
    """

    name: str
    family: Family
    dtype: torch.dtype | None
    matmul: str | None
    build: Callable[[str, str], Precision]
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PrecisionSupport:
    """What a strategy or an accelerator carries, by property rather than by name.

    Attributes:
        families: the families it carries.
        true_dtypes: the weight dtypes of the `true` family it carries (`None`: any).
        mixed_dtypes: the autocast dtypes of the `mixed` family it carries (`None`: any).
        hardware: the hardware features its devices have (`None`: it does not restrict, as a
            strategy does not); a precision that needs one it lacks is not supported.
    """

    families: frozenset[str] = FAMILIES
    true_dtypes: frozenset[torch.dtype] | None = None
    mixed_dtypes: frozenset[torch.dtype] | None = None
    hardware: frozenset[str] | None = None

    def accepts(self, entry: PrecisionEntry) -> bool:
        """Whether it carries the precision of `entry`."""
        if entry.family not in self.families:
            return False
        dtypes = {"true": self.true_dtypes, "mixed": self.mixed_dtypes}.get(entry.family)
        if dtypes is not None and entry.dtype not in dtypes:
            return False
        return self.hardware is None or entry.needs <= self.hardware

    def names(self) -> frozenset[str]:
        """The names of the precisions it carries, read from the table now."""
        return frozenset(name for name, entry in _TABLE.items() if self.accepts(entry))

    def replace(self, **changes: Any) -> PrecisionSupport:
        """A copy with `changes` (e.g. a strategy instance that carries one more dtype)."""
        return dataclasses.replace(self, **changes)


class SupportedPrecisions:
    """`supported_precisions` on a strategy or accelerator class: the names its `precision_support`
    accepts, on the class and on an instance (whose own `precision_support` wins). A class may
    still set `supported_precisions` to a set of names, which then replaces this."""

    def __get__(self, obj: Any, owner: type) -> frozenset[str]:
        return (obj if obj is not None else owner).precision_support.names()


def _true(name: str, device_type: str) -> Precision:
    return TruePrecision(name, precision_entry(name).dtype)  # type: ignore[arg-type]


def _mixed(name: str, device_type: str) -> Precision:
    return MixedPrecision(name, device_type)


def _fp8(name: str, device_type: str) -> Precision:
    return Float8Precision(name.removeprefix("fp8-"), device_type=device_type)


def _bitsandbytes(name: str, device_type: str) -> Precision:
    return QuantizedPrecision(name)


def _torchao_nf4(name: str, device_type: str) -> Precision:
    return TorchaoNF4Precision()


def _plain(name: str, device_type: str) -> Precision:
    return Precision()


_FP8 = frozenset({"fp8"})
_TABLE: dict[str, PrecisionEntry] = {row.name: row for row in [
    PrecisionEntry("64-true", "true", torch.float64, "fp64", _true),
    PrecisionEntry("32-true", "true", torch.float32, None, _plain),
    PrecisionEntry("16-true", "true", torch.float16, "fp16", _true),
    PrecisionEntry("bf16-true", "true", torch.bfloat16, "bf16", _true),
    PrecisionEntry("16-mixed", "mixed", torch.float16, "fp16", _mixed),
    PrecisionEntry("bf16-mixed", "mixed", torch.bfloat16, "bf16", _mixed),
    PrecisionEntry("fp8-tensorwise", "fp8", None, "fp8", _fp8, needs=_FP8),
    PrecisionEntry("fp8-rowwise", "fp8", None, "fp8", _fp8, needs=_FP8),
    *[PrecisionEntry(mode, "quantized", None, None, _bitsandbytes) for mode in MODES],
    PrecisionEntry("nf4-torchao", "sharded-quantized", None, None, _torchao_nf4),
]}


def precision_entry(name: str) -> PrecisionEntry:
    """The row of precision `name` (a name `normalize_precision` returned)."""
    return _TABLE[name]


def precision_names(family: str | None = None) -> frozenset[str]:
    """The names in the table now, or those of one family."""
    return frozenset(name for name, row in _TABLE.items() if family is None or row.family == family)


def register_precision(row: PrecisionEntry) -> None:
    """Add a precision to the table (a backend's own, or a test's); its name must be new."""
    if row.name in _TABLE:
        raise ConfigurationError(f"precision {row.name!r} is in the table already: give the new one another name.")
    if row.family not in FAMILIES:
        raise ConfigurationError(f"PrecisionEntry(family={row.family!r}) is not a family: pass one of {sorted(FAMILIES)}.")
    _TABLE[row.name] = row


def unregister_precision(name: str) -> None:
    """Take a precision `register_precision` added out of the table again."""
    _TABLE.pop(name, None)


# The names as sets, as they are when Lite is imported (for code that reads them as constants).
#: FP8 through torchao (`Float8Precision`): only accelerators whose devices have FP8 run these.
FP8_PRECISIONS: frozenset[str] = precision_names("fp8")
#: Quantized frozen base weights through bitsandbytes (`QuantizedPrecision`, QLoRA): only strategies
#: that keep whole weights on each process run these.
QUANTIZED_PRECISIONS: frozenset[str] = precision_names("quantized")
#: NF4 frozen base weights through torchao (`TorchaoNF4Precision`), a tensor subclass that FSDP2
#: shards: for the strategies that shard parameters with `fully_shard`.
SHARDED_QUANTIZED_PRECISIONS: frozenset[str] = precision_names("sharded-quantized")
PRECISIONS: frozenset[str] = precision_names()

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
    if isinstance(precision, str) and precision in _TABLE:
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
        f"precision={precision!r} is not supported: {hint}choose one of {sorted(_TABLE)}."
    )


def _guess(precision: Any) -> str | None:
    if not isinstance(precision, str):
        return None
    spellings = {**{name: name for name in _TABLE}, **{str(k): v for k, v in _LEGACY.items()}, **_OTHER_SPELLINGS}
    key = closest(precision.strip().lower(), spellings)
    return spellings[key] if key is not None else None


def unsupported_hint(name: str, by_strategy: bool = False) -> str:
    """What to add to the sentence refusing precision `name` on an accelerator without it (or, with
    `by_strategy`, under a strategy without it)."""
    family = _TABLE[name].family if name in _TABLE else None
    if by_strategy and family == "quantized":
        return (f"; {name!r} keeps whole quantized weights on each process, which a strategy that shards"
                " or copies parameters cannot carry: choose strategy='ddp' or 'single_device', or"
                " precision='nf4-torchao' (torchao's NF4, which fsdp and model_parallel shard)")
    if by_strategy and family == "sharded-quantized":
        return (f"; {name!r} is torchao's NF4 for the strategies that shard parameters with FSDP2 (DDP's"
                " broadcast of the parameters corrupts its statistics): choose strategy='fsdp', 'model_parallel'"
                " or 'single_device', or precision='nf4' (bitsandbytes) under ddp")
    if by_strategy:
        return ""
    if family == "fp8":
        recipe = name.removeprefix("fp8-")
        return (f", or emulate FP8 (slow; for tests and debugging) with"
                f" precision=Float8Precision({recipe!r}, emulate=True)")
    return ""
