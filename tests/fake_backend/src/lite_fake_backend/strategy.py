"""`strategy="fake_single"`: one process, on the fake accelerator only."""

from __future__ import annotations

from lite_core.plugins import SingleDeviceStrategy


class FakeSingleStrategy(SingleDeviceStrategy):
    """A single-device strategy that declares it runs only on `accelerator="fake"`."""

    name = "fake_single"
    supported_accelerators = frozenset({"fake"})
