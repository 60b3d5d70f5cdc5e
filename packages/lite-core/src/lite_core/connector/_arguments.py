"""Checks of the arguments given to `LightningLite`'s constructor.

Each raises one sentence that names what was wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError
from lite_core.loggers.logger import share_run_folders


def legacy_devices(accelerator: Any, devices: Any, *, gpus: Any, tpu_cores: Any) -> tuple[Any, Any]:
    for flag, value, name in (("gpus", gpus, "cuda"), ("tpu_cores", tpu_cores, "tpu")):
        if value is None:
            continue
        if accelerator not in ("auto", name) or devices != "auto":
            raise ConfigurationError(
                f"{flag}={value!r} cannot be combined with accelerator/devices: pass only"
                f" accelerator={name!r}, devices={value!r}."
            )
        warn_user(f"{flag}= is deprecated: pass accelerator={name!r}, devices={value!r} instead.", DeprecationWarning)
        return name, value
    return accelerator, devices


def checked_loggers(loggers: list[Any]) -> list[Any]:
    """`loggers`, each checked to be one, the built-in ones of one folder sharing one `version_N`."""
    for logger in loggers:
        if not callable(getattr(logger, "log_metrics", None)):
            raise ConfigurationError(
                f"loggers got {logger!r}, which has no log_metrics(metrics, step) method: pass a Logger such as"
                " CSVLogger('logs') or TensorBoardLogger('logs')."
            )
    share_run_folders(loggers)
    return loggers


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else [value]
