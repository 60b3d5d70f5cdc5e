"""The core's precision plugin for each precision name."""

from __future__ import annotations

from lite_core.precision.names import precision_entry
from lite_core.precision.precision import Precision


def build_precision(name: str, device_type: str) -> Precision:
    """The core's precision plugin for a normalised precision `name` on `device_type`, as its row
    in the table (`lite_core.precision.names`) builds it."""
    return precision_entry(name).build(name, device_type)
