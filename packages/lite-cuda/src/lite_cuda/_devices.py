"""Turns the user's `devices` argument into indexes of visible GPUs, or one-sentence errors."""

from __future__ import annotations

import os
from typing import Any

from lite_core.plugins import ConfigurationError


def parse_devices(devices: Any, visible: int) -> list[int]:
    """Indexes (counted within `CUDA_VISIBLE_DEVICES`) of the GPUs `devices` asks for.

    `"auto"`/`None`: GPU 0; an int `n` (or `"n"`): the first `n`; `-1` (or `"-1"`): all; a list
    (or `"0,2"`, `"1,"`): those indexes.
    """
    if devices is None or devices == "auto":
        return [0]
    wanted = _from_string(devices) if isinstance(devices, str) else devices
    if isinstance(wanted, int) and not isinstance(wanted, bool):
        return _first(devices, wanted, visible)
    if isinstance(wanted, (list, tuple)) and wanted and all(_is_index(i) for i in wanted):
        return _chosen(devices, list(wanted), visible)
    raise _invalid(devices)


def _from_string(text: str) -> Any:
    text = text.strip()
    if "," in text:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None
    return int(text) if text.lstrip("-").isdigit() else None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _first(devices: Any, count: int, visible: int) -> list[int]:
    if count == -1:
        return list(range(visible))
    if count < 1:
        raise _invalid(devices)
    if count > visible:
        raise ConfigurationError(
            f"devices={devices!r} asks for {count} GPUs but {_visible_words(visible)}: pass"
            f" devices={visible} or fewer (devices=-1 takes every visible GPU)."
        )
    return list(range(count))


def _chosen(devices: Any, indexes: list[int], visible: int) -> list[int]:
    twice = next((i for i in indexes if indexes.count(i) > 1), None)
    if twice is not None:
        raise ConfigurationError(f"devices={devices!r} names GPU {twice} twice: list each GPU once.")
    missing = next((i for i in indexes if i >= visible), None)
    if missing is not None:
        raise ConfigurationError(
            f"devices={devices!r} names GPU {missing} but the visible GPUs are"
            f" {list(range(visible))}{_within_visible()}: pass indexes from that list."
        )
    return indexes


def _visible_words(visible: int) -> str:
    verb = "is" if visible == 1 else "are"
    return f"only {visible} {verb} visible{_within_visible()}"


def _within_visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (counted within CUDA_VISIBLE_DEVICES={value!r})"


def _invalid(devices: Any) -> ConfigurationError:
    return ConfigurationError(
        f"devices={devices!r} is not valid for accelerator='cuda': pass a number of GPUs (2), indexes"
        " ([0, 2] or '0,2'), -1 for every visible GPU, or 'auto' for one."
    )
