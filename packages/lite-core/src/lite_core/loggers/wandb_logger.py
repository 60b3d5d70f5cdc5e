"""`WandbLogger`: metrics, the config and files in one Weights & Biases run per job, through `wandb`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lite_core.loggers._tracker import TrackerLogger, config_as_dict, global_rank, job_run_key, require_package


class WandbLogger(TrackerLogger):
    """Logs to one W&B run per job, from global rank 0 only (the other ranks import nothing).

    The run starts (or, after `load`, resumes with `wandb.init(id=..., resume="allow")`) at the
    first value logged, so `log_hyperparams` before `self.load(...)` still continues the saved run.
    Put the logger in the state you save (`self.save({"model": model, "logger": logger}, path)`)
    and the resumed job appends to the same run; steps the resume repeats are not logged again.

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

    @property
    def experiment(self) -> Any:
        """The `wandb` run (started on first use; `None` off the logging process, global rank 0): for
        what this logger does not wrap, such as `logger.experiment.log({"image": wandb.Image(...)})`."""
        self._refuse_after_finalize("experiment")
        return self._open() if self._logs() else None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log `metrics` at `step` (W&B's `_step`)."""
        self._log_to_run(metrics, step)

    def log_hyperparams(self, config: Any) -> None:
        """Record the user's config (a dict, a dataclass or an argparse Namespace) as the run's config."""
        self._refuse_after_finalize("log_hyperparams")
        if global_rank() != 0:
            return
        values = config_as_dict(config)
        if self._run is None:
            self._config.update(values)
        else:
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
            self._config = {}
            self._run_id = self._opened_run_id = str(self._run.id)
            # Online, a resumed run knows the steps it already holds (logged after the checkpoint by
            # the job that was interrupted); offline it does not, and W&B drops them when syncing.
            if getattr(self._run, "resumed", False) and self._run.step:
                self._resumed_at(int(self._run.step) - 1)
        return self._run

    def _close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            self._opened_run_id = None
