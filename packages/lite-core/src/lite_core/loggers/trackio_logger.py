"""`TrackioLogger`: metrics, the config and files in one trackio run per job, through `trackio`,
whose store is a local SQLite file (a local-first tracker: no server, no account)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lite_core.errors import MisuseError
from lite_core.loggers._tracker import TrackerLogger, config_as_dict, global_rank, job_run_key, require_package


class TrackioLogger(TrackerLogger):
    """Logs to one trackio run per job, from global rank 0 only (the other ranks import nothing).

    trackio keeps its runs in a SQLite file per project under `TRACKIO_DIR` (by default
    `~/.cache/huggingface/trackio`); `trackio show` opens its dashboard. The run starts at the
    first value logged. Put the logger in the state you save
    (`self.save({"model": model, "logger": logger}, path)`) and the resumed job appends to the
    same run (`trackio.init(name=..., resume="allow")`); steps the resume repeats are not logged
    again, nor those the interrupted job logged after its checkpoint (read from the local store).

    A `save` of a state holding the logger finishes the run before the checkpoint is written
    (trackio writes to its store every half second; `finish()` waits for that), and the next value
    continues it, so a job killed after the checkpoint loses no step the checkpoint covers.

    trackio resumes a run by its name, so the name is this logger's `run_id`: leave `name` unset
    (trackio picks a new one) or give each job its own. trackio stores a run's config with the
    first value each process logs, so `log_hyperparams` is taken before the first value only; a
    resumed run whose job does not log its config again keeps the config it had.

    With `LITE_JOB_ID` set (`lite run --replica-groups` sets it) and no `name`, the run's name
    comes from it and an existing run of that name is continued, so every process that comes to
    log for the job (the replica group that takes over under `ddp_ft`) continues one run.

    Needs `pip install 'lite-core[trackio]'`.

    Args:
        project: the trackio project.
        name: the run's name (its id for resuming); `None` lets trackio choose one.
        group: a group of runs in the dashboard.
        **init_kwargs: passed on to `trackio.init` (`server_url`, `space_id`, ...).

    Raises:
        MissingDependencyError: `trackio` is not installed.
    """

    _name = "TrackioLogger"

    def __init__(self, project: str = "lite", name: str | None = None, group: str | None = None,
                 **init_kwargs: Any) -> None:
        require_package("trackio", "TrackioLogger", "trackio")
        super().__init__()
        self._project = project
        self._init_kwargs = {"group": group, "auto_log_cpu": False, "auto_log_gpu": False, "embed": False,
                             **init_kwargs}
        self._run_id = self._given_name = name
        self._fresh = True  # no run of this job exists yet: a given name starts a new run
        self._config: dict[str, Any] = {}
        self._run: Any = None
        self._continuing = False  # the next `trackio.init` continues this process's own run after a checkpoint

    @property
    def experiment(self) -> Any:
        """The `trackio` run (started on first use; `None` off the logging process, global rank 0)."""
        self._refuse_after_finalize("experiment")
        return self._open() if self._logs() else None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved run (see `TrackerLogger.load_state_dict`)."""
        super().load_state_dict(state)
        self._fresh = self._run_id is None  # saved before its first value: this job has no run yet
        if self._fresh:
            self._run_id = self._given_name

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log `metrics` at `step`."""
        self._log_to_run(metrics, step)

    def log_hyperparams(self, config: Any) -> None:
        """Record the user's config (a dict, a dataclass or an argparse Namespace) as the run's config."""
        self._refuse_after_finalize("log_hyperparams")
        if global_rank() != 0:
            return
        if self._run is not None:
            raise MisuseError(
                "TrackioLogger sends the config with the run's first value, which was already logged: call"
                " log_hyperparams before the first log."
            )
        self._config.update(config_as_dict(config))

    def log_artifact(self, path: str | os.PathLike[str]) -> None:
        """Store a file (a checkpoint, a figure) or folder as an artifact of the run."""
        self._refuse_after_finalize("log_artifact")
        if not self._logs():
            return
        self._open().log_artifact(os.fspath(path))

    def _open(self) -> Any:
        if self._run is None:
            import trackio

            continuing = self._run_id is not None and not self._fresh  # the run of a loaded checkpoint
            shared = job_run_key() if not continuing else None
            if shared is not None:  # one run for every process of the job: trackio continues it if it exists
                self._run_id = self._run_id or shared
            if (continuing or shared) and not self._config:
                self._config = self._stored_config()  # trackio would otherwise replace it with none
            self._run = trackio.init(project=self._project, name=self._run_id, config=self._config or None,
                                     resume="allow" if continuing or shared else "never", **self._init_kwargs)
            self._run_id = self._opened_run_id = str(self._run.name)
            self._fresh = False
            if (continuing or shared) and not self._continuing:  # the store may hold steps logged elsewhere
                self._resumed_at(self._stored_last_step())
            self._continuing = False
        return self._run

    def _persist(self) -> None:
        """Finish the run (the next value continues it): trackio writes to its store from a thread
        every half second, and `finish()` waits for that thread, so the steps logged so far are in
        the store when this returns."""
        if self._run is not None:
            self._close()
            self._continuing = True

    def _stored_config(self) -> dict[str, Any]:
        from trackio.sqlite_storage import SQLiteStorage

        stored = SQLiteStorage.get_run_config(project=self._project, run=self._run_id) or {}
        return {key: value for key, value in stored.items() if not key.startswith("_")}

    def _stored_last_step(self) -> int:
        """The last step the local store holds for the run (-1 for none, or a remote store)."""
        from trackio.sqlite_storage import SQLiteStorage

        last = SQLiteStorage.get_max_step_for_run(self._project, run=self._run_id)
        return -1 if last is None else int(last)

    def _close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            self._opened_run_id = None
