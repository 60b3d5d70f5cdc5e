"""Checks of the arguments given to `LightningLite`'s constructor and setup methods.

Each raises one sentence that names what was wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError, MisuseError
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


def check_module(model: Any, method: str) -> None:
    if not isinstance(model, nn.Module):
        raise MisuseError(f"{method}() takes the model first but got {type(model).__name__}: pass your torch.nn.Module.")


def check_optimizers(optimizers: tuple[Any, ...], method: str) -> None:
    for optimizer in optimizers:
        if not isinstance(optimizer, Optimizer):
            raise MisuseError(
                f"{method}() got {type(optimizer).__name__} where an optimizer belongs: pass torch.optim.Optimizer"
                " objects built from the model's parameters."
            )


def check_optimizers_belong(model: nn.Module, optimizers: tuple[Optimizer, ...]) -> None:
    owned = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if owned and params and not any(id(p) in owned for p in params):
            raise MisuseError(
                f"An optimizer passed to setup() with {type(model).__name__} holds none of its parameters: build it"
                " from model.parameters(), or set it up together with the model it belongs to."
            )


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else [value]
