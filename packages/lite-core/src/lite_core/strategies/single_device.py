"""One process on one device."""

from __future__ import annotations

from lite_core.strategies.strategy import Strategy
from lite_core.precision.names import PrecisionSupport


class SingleDeviceStrategy(Strategy):
    """Runs the user's loop in this process on one device, exactly as plain PyTorch would."""

    name = "single_device"
    precision_support = PrecisionSupport()  # every precision: one process holds the whole model
