"""The logger protocol, and the run folder the built-in loggers write into."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Logger(Protocol):
    """What `LightningLite(loggers=...)` accepts: any object with these methods, no subclassing.

    Lite calls `log_metrics` on global rank 0 only, and `finalize` (when the object has it) when
    `run()` or `launch(fn)` returns or fails, and at exit after `launch()` without a function. A
    logger must accept more `log_metrics` calls after `finalize` when Lite starts a second `run()`
    (the built-in file loggers reopen their files; the tracker loggers continue their run then,
    and refuse logging outside a run once finalized).

    Example, a Weights & Biases logger in a few lines:

        class WandbLogger:
            def __init__(self, **init_kwargs):
                import wandb
                self._run = wandb.init(**init_kwargs)

            def log_metrics(self, metrics, step=None):
                self._run.log(dict(metrics), step=step)

            def finalize(self):
                self._run.finish()
    """

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record `metrics` (name to number) at `step` (`None`: the logger counts steps itself)."""

    def finalize(self) -> None:
        """Flush what is buffered and release files; logging again afterwards reopens them."""


def version_folder(root_dir: str | os.PathLike[str], name: str, version: int | str | None) -> Path:
    """`root_dir/name/version_N`: `N` is `version`, or one more than the highest existing one."""
    base = Path(root_dir) / name
    if version is None:
        existing = [int(m.group(1)) for p in base.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
        version = max(existing, default=-1) + 1
    folder = f"version_{version}" if isinstance(version, int) else str(version)
    return base / folder


class StepCounter:
    """The step to record: the one given, else one more than the last one recorded."""

    def __init__(self) -> None:
        self._next = 0

    def step(self, given: int | None) -> int:
        step = self._next if given is None else int(given)
        self._next = step + 1
        return step


class FolderLogger:
    """Shared base of the built-in loggers: a run folder chosen on first use, and a step counter."""

    def __init__(self, root_dir: str | os.PathLike[str], name: str, version: int | str | None) -> None:
        self._root_dir = root_dir
        self._name = name
        self._version = version
        self._log_dir: Path | None = None
        self._steps = StepCounter()
        self._run: _RunFolder | None = None

    @property
    def log_dir(self) -> Path:
        """The folder this logger writes into (chosen on first use; the same for every built-in
        logger of one `LightningLite` under the same `root_dir/name`, see `share_run_folders`)."""
        if self._log_dir is None:
            run = self._run if self._run is not None else _RunFolder()
            if run.folder is None:
                run.folder = version_folder(self._root_dir, self._name, self._version)
            self._log_dir = run.folder
        return self._log_dir


class _RunFolder:
    """The `version_N` folder that the loggers of one run share, picked by whichever logs first."""

    def __init__(self) -> None:
        self.folder: Path | None = None


def share_run_folders(loggers: list[Any]) -> None:
    """Make the built-in loggers of one run that pick their version themselves (`version=None`)
    under the same `root_dir/name` write into one `version_N` folder, not one each: e.g.
    `CSVLogger("logs")` and `TensorBoardLogger("logs")` of one `LightningLite`."""
    runs: dict[Path, _RunFolder] = {}
    for logger in loggers:
        if isinstance(logger, FolderLogger) and logger._version is None and logger._log_dir is None:
            logger._run = runs.setdefault(Path(logger._root_dir).resolve() / logger._name, _RunFolder())
