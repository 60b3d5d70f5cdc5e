"""`strategy="single_xla"`: one process on one XLA device (chosen for `devices=1`)."""

from __future__ import annotations

from lite_xla.strategies._base import XLAStrategyBase


class SingleXLAStrategy(XLAStrategyBase):
    """Runs the user's loop in this process on one XLA device (`devices=1` or `devices=[i]`)."""

    name = "single_xla"
