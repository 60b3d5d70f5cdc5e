"""The logger protocol, and the run folder the built-in loggers write into."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lite_core.errors import MisuseError


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
        self.last = -1  # the highest step recorded so far

    def step(self, given: int | None) -> int:
        step = self._next if given is None else int(given)
        self._next = step + 1
        self.last = max(self.last, step)
        return step

    def resume_after(self, step: int) -> None:
        """Continue after `step`, the last one a checkpoint recorded."""
        self._next = max(self._next, step + 1)
        self.last = max(self.last, step)


class FolderLogger:
    """Shared base of the built-in file loggers: a run folder chosen on first use, a step counter,
    and the folder and last step as checkpointable state (one run folder per job across restarts)."""

    def __init__(self, root_dir: str | os.PathLike[str], name: str, version: int | str | None) -> None:
        self._root_dir = root_dir
        self._name = name
        self._version = version
        self._log_dir: Path | None = None
        self._steps = StepCounter()
        self._run = _RunFolder()  # this logger's own, or one shared with the other loggers of its run
        self._skip_through = -1  # steps up to this one were logged before a resume: not again
        self._wrote = False  # whether this logger has written into its folder

    @property
    def log_dir(self) -> Path:
        """The folder this logger writes into (chosen on first use; the same for every built-in
        logger of one `LightningLite` under the same `root_dir/name`, see `share_run_folders`, and
        the checkpoint's folder after `load_state_dict`)."""
        if self._log_dir is None:
            if self._run.folder is None:
                self._run.folder = version_folder(self._root_dir, self._name, self._version)
            self._log_dir = self._run.folder
            if self._run.resumed_after >= 0:  # the folder of a loaded checkpoint (this logger's or another's)
                self._skip_through = max(self._skip_through, self._run.resumed_after)
                self._steps.resume_after(self._run.resumed_after)
                self._resume(self._run.resumed_after)
        return self._log_dir

    def _step_to_log(self, given: int | None) -> int | None:
        """The step of this value, or `None` when a resumed job repeats a step the checkpoint covers
        (the folder is chosen first: one restored by another logger of the run resumes this one too)."""
        _ = self.log_dir
        step = self._steps.step(given)
        return None if step <= self._skip_through else step

    def state_dict(self) -> dict[str, Any]:
        """`{"version": ..., "last_step": ...}`, taken after writing what is buffered, so that what the
        checkpoint covers is on disk before the checkpoint is: put the logger in the state you
        `save`, and `load` makes the resumed job write into the same folder."""
        self._persist()
        return {"version": None if self._log_dir is None else self._log_dir.name, "last_step": self._steps.last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the checkpoint's run folder: later values go into `state["version"]` under
        `root_dir/name`, the steps up to `state["last_step"]` that the resumed job repeats are not
        written again, and what the interrupted job wrote after that step is dropped."""
        version = state.get("version")
        if version is None:  # saved before the first value: this job has no folder yet
            return
        folder = Path(self._root_dir) / self._name / str(version)
        if self._wrote and self._log_dir != folder:
            raise MisuseError(
                f"{type(self).__name__} already wrote into '{self._log_dir}' before loading the checkpoint of"
                f" '{folder}': call self.load(...) before the first log so that the job continues its folder."
            )
        last_step = int(state.get("last_step", -1))
        self._run.folder, self._run.resumed_after = folder, max(self._run.resumed_after, last_step)
        self._log_dir = None  # taken again from the run folder, with its resume point
        _ = self.log_dir

    def _persist(self) -> None:
        """Write what is buffered to disk (each logger's own)."""

    def _resume(self, last_step: int) -> None:
        """The folder is the checkpoint's: forget what was logged there after `last_step` (each
        logger's own)."""


class _RunFolder:
    """The `version_N` folder that the loggers of one run share, picked by whichever logs first
    (or restored from a checkpoint by whichever loads first, with the step it covers)."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.resumed_after = -1  # the last step of the checkpoint this folder was restored from


def share_run_folders(loggers: list[Any]) -> None:
    """Make the built-in loggers of one run that pick their version themselves (`version=None`)
    under the same `root_dir/name` write into one `version_N` folder, not one each: e.g.
    `CSVLogger("logs")` and `TensorBoardLogger("logs")` of one `LightningLite`."""
    runs: dict[Path, _RunFolder] = {}
    for logger in loggers:
        if isinstance(logger, FolderLogger) and logger._version is None and logger._log_dir is None:
            logger._run = runs.setdefault(Path(logger._root_dir).resolve() / logger._name, _RunFolder())
