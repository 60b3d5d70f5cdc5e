"""`WandbLogger`: metrics, the config and files in one Weights & Biases run per job, through `wandb`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lite_core._user_frame import warn_user
from lite_core.loggers._tracker import TrackerLogger, config_as_dict, global_rank, job_run_key, require_package


class WandbLogger(TrackerLogger):
    """Logs to one W&B run per job, from global rank 0 only (the other ranks import nothing).

    The run starts (or, after `load`, resumes with `wandb.init(id=..., resume="allow")`) at the
    first value logged, so `log_hyperparams` before `self.load(...)` still continues the saved run.
    Put the logger in the state you save (`self.save({"model": model, "logger": logger}, path)`)
    and the resumed job appends to the same run; steps the resume repeats are not logged again.

    A `save` of a state holding the logger finishes the run and continues it at once, before the
    checkpoint is written: W&B stores a run's records for sure only when it finishes (offline, its
    service writes the `.wandb` file every 15 s otherwise), so a job killed after the checkpoint
    loses no step the checkpoint covers. Offline, each checkpoint so starts a new
    `offline-run-*` folder of the same run id, which `wandb sync` joins; `experiment` is a new
    `wandb` run object after each checkpoint. Values for the checkpoint's step logged after the
    `save` are refused with a warning (W&B takes none for a step it has moved past).

    With `LITE_JOB_ID` set (`lite run --replica-groups` sets it), the run's id comes from it
    (`wandb.init(id=..., resume="allow")`), so every process that comes to log for the job (the
    replica group that takes over under `ddp_ft`) continues one run.

    Needs `pip install 'lite-core[wandb]'`. Offline (`mode="offline"` or `WANDB_MODE=offline`)
    the run is written under `save_dir/wandb/` for `wandb sync`.

    Args:
        project: the W&B project.
        name: the run's display name.
        save_dir: the folder W&B writes its local files into (`wandb.init(dir=...)`).
        mode: `"online"`, `"offline"` or `"disabled"`; `None` follows `WANDB_MODE`.
        **init_kwargs: passed on to `wandb.init` (`entity`, `group`, `tags`, ...).

    Raises:
        MissingDependencyError: `wandb` is not installed.
    """

    _name = "WandbLogger"

    def __init__(self, project: str | None = None, name: str | None = None,
                 save_dir: str | os.PathLike[str] | None = None, mode: str | None = None, **init_kwargs: Any) -> None:
        require_package("wandb", "WandbLogger", "wandb")
        super().__init__()
        self._init_kwargs = {"project": project, "name": name, "mode": mode, **init_kwargs}
        self._save_dir = save_dir
        self._config: dict[str, Any] = {}
        self._run: Any = None
        self._persisted_through = -1  # the last step a checkpoint wrote to the run (see `_persist`)
        self._continuing = False  # the next `wandb.init` continues this process's own run after a checkpoint
        self._warned_late = False

    @property
    def experiment(self) -> Any:
        """The `wandb` run (started on first use; `None` off the logging process, global rank 0): for
        what this logger does not wrap, such as `logger.experiment.log({"image": wandb.Image(...)})`."""
        self._refuse_after_finalize("experiment")
        return self._open() if self._logs() else None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log `metrics` at `step` (W&B's `_step`); values for a step that a checkpoint has already
        written to the run are refused with a warning (W&B takes none once it moved past a step)."""
        self._refuse_after_finalize("log_metrics")
        if step is not None and self._skip_through < int(step) <= self._persisted_through and self._logs():
            self._refuse_after_checkpoint(int(step))
            return
        self._log_to_run(metrics, step)

    def _refuse_after_checkpoint(self, step: int) -> None:
        if not self._warned_late:
            self._warned_late = True
            warn_user(f"WandbLogger did not log values for step {step} because a checkpoint had already written"
                      " that step to the run, and W&B takes no values for a step it has moved past: log a"
                      " step's values before you save the checkpoint that covers it.")

    def log_hyperparams(self, config: Any) -> None:
        """Record the user's config (a dict, a dataclass or an argparse Namespace) as the run's config."""
        self._refuse_after_finalize("log_hyperparams")
        if global_rank() != 0:
            return
        values = config_as_dict(config)
        self._config.update(values)  # kept, for the run's continuation after each checkpoint
        if self._run is not None:
            self._run.config.update(values, allow_val_change=True)

    def log_artifact(self, path: str | os.PathLike[str]) -> None:
        """Save a file (a checkpoint, a figure) with the run: it appears under the run's files."""
        self._refuse_after_finalize("log_artifact")
        if not self._logs():
            return
        file = Path(path).resolve()
        self._open().save(str(file), base_path=str(file.parent), policy="now")

    def _open(self) -> Any:
        if self._run is None:
            import wandb

            if self._save_dir is not None:
                Path(self._save_dir).mkdir(parents=True, exist_ok=True)
            kwargs = {key: value for key, value in self._init_kwargs.items() if value is not None}
            run_id = self._run_id or job_run_key()
            if run_id is not None:
                kwargs.update(id=run_id, resume="allow")
            self._run = wandb.init(dir=None if self._save_dir is None else str(self._save_dir),
                                   config=self._config or None, **kwargs)
            self._run_id = self._opened_run_id = str(self._run.id)
            # Online, a resumed run knows the steps it already holds (logged after the checkpoint by
            # the job that was interrupted); offline it does not, and W&B drops them when syncing.
            # A run this process continues after its own checkpoint holds only what it logged.
            if getattr(self._run, "resumed", False) and self._run.step and not self._continuing:
                self._resumed_at(int(self._run.step) - 1)
            self._continuing = False
        return self._run

    def _persist(self) -> None:
        """Finish the run and continue it at once: W&B's service writes a run's records to its
        `.wandb` file (offline) and the server (online) for sure only when the run finishes, and a
        `wandb.init` returns only once the service has closed the run finished before it, so the
        steps logged so far are stored when this returns."""
        if self._run is None:
            return
        self._close()
        self._persisted_through = self._last_step
        self._continuing = True
        self._open()

    def _close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            self._opened_run_id = None
