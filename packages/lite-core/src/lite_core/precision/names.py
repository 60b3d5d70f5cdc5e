"""The precision names Lite accepts, and the legacy spellings it maps onto them."""

from __future__ import annotations

from typing import Any

from lite_core._suggest import closest
from lite_core.errors import ConfigurationError

PRECISIONS: frozenset[str] = frozenset(
    {"64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}
)

_LEGACY = {64: "64-true", 32: "32-true", 16: "16-mixed", "64": "64-true", "32": "32-true",
           "16": "16-mixed", "bf16": "bf16-mixed"}


def normalize_precision(precision: Any) -> str:
    """Map `precision` (including the legacy 64/32/16/"bf16") onto one of `PRECISIONS`."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    if isinstance(precision, (int, str)) and not isinstance(precision, bool):
        if precision in _LEGACY:
            return _LEGACY[precision]
    guess = closest(precision, PRECISIONS) if isinstance(precision, str) else None
    hint = f"did you mean {guess!r}? " if guess else ""
    raise ConfigurationError(
        f"precision={precision!r} is not supported: {hint}choose one of {sorted(PRECISIONS)}."
    )
