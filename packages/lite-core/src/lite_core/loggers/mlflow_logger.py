"""`MLflowLogger`: metrics, hyperparameters and artifacts in one MLflow run per job, through
`mlflow.MlflowClient`; what an unreachable tracking server could not take is kept, never lost."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lite_core._user_frame import warn_user
from lite_core.loggers._tracker import (TrackerLogger, config_as_dict, flatten, global_rank, job_run_key,
                                        require_package)


_JOB_TAG = "lite.job"  # the tag that marks the run of a job with `LITE_JOB_ID` set


class MLflowLogger(TrackerLogger):
    """Logs to one MLflow run per job, from global rank 0 only (the other ranks import nothing).

    The run is created (or, after `load`, reopened) at the first value logged, which is sent at
    once. Metrics are then sent in batches, every `flush_every` `log_metrics` calls, at a `save` of
    a state holding the logger (before the checkpoint is written) and in `finalize()`. When the
    tracking server does not answer, one warning says so (at the first value already), training
    goes on, and the metrics stay buffered and are sent at the next flush that reaches it; whatever
    is still unsent at `finalize()` is written to `fallback_dir/mlflow-unsent-<run>.jsonl` (one
    JSON object per metric, parameter or artifact).

    Put the logger in the state you save (`self.save({"model": model, "logger": logger}, path)`)
    and the resumed job appends to the same run; steps the resume repeats are not logged again.

    With `LITE_JOB_ID` set (`lite run --replica-groups` sets it), the run carries the tag
    `lite.job` and a process that opens a run first looks for the job's run by that tag, so every
    process that comes to log for the job (the replica group that takes over under `ddp_ft`)
    continues one run.

    Needs `pip install 'lite-core[mlflow]'`.

    Args:
        experiment_name: the MLflow experiment (created if it does not exist).
        tracking_uri: the tracking server (`http://host:port`) or store; `None` uses MLflow's
            default (`MLFLOW_TRACKING_URI`, else `./mlruns`).
        run_name: the run's name in the UI.
        tags: tags set on the run.
        flush_every: send buffered metrics after this many `log_metrics` calls.
        fallback_dir: where unsent values are written at `finalize()` if the server is down.
        request_timeout: seconds one request to the server may take (`MLFLOW_HTTP_REQUEST_TIMEOUT`,
            set only when you have not set it) before the values are kept for later; MLflow's
            own retries are turned off the same way, so a dead server costs one request per flush.

    Raises:
        MissingDependencyError: `mlflow` is not installed.
    """

    _name = "MLflowLogger"

    def __init__(self, experiment_name: str = "lite", tracking_uri: str | None = None, run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, flush_every: int = 20,
                 fallback_dir: str | os.PathLike[str] = ".", request_timeout: int = 10) -> None:
        require_package("mlflow", "MLflowLogger", "mlflow")
        super().__init__()
        self._experiment_name = experiment_name
        self._tracking_uri = tracking_uri
        self._run_name = run_name
        self._tags = dict(tags or {})
        self._flush_every = flush_every
        self._fallback_dir = Path(fallback_dir)
        self._request_timeout = request_timeout
        self._client: Any = None
        self._metrics: list[tuple[str, float, int, int]] = []  # key, value, timestamp (ms), step
        self._params: dict[str, str] = {}
        self._artifacts: list[str] = []
        self._calls = 0
        self._warned = False

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Buffer `metrics` at `step`; send the first values at once (which opens the run, so that a
        server that does not answer is reported at the first log), then the buffer every
        `flush_every` calls."""
        self._refuse_after_finalize("log_metrics")
        if not self._logs():
            self._keep_unsent(metrics, step)
            self._hand_over()
            return
        now = int(time.time() * 1000)
        for early, values in self._take_unsent(None if step is None else int(step)):  # sent unless the run holds them
            self._metrics.extend((name, float(value), now, early) for name, value in values.items())
        step = self._next_step(step)
        if step is None:
            return
        self._metrics.extend((name, float(value), now, step) for name, value in metrics.items())
        self._calls += 1
        if self._calls == 1 or self._calls % self._flush_every == 0:  # the first value opens the run
            self.flush()

    def log_hyperparams(self, config: Any) -> None:
        """Record the user's config (a dict, a dataclass or an argparse Namespace) as the run's
        parameters; nested values become dotted names (`optimizer.lr`). They are sent with the next
        metrics, so calling this before `self.load(...)` still resumes the saved run."""
        self._refuse_after_finalize("log_hyperparams")
        if global_rank() != 0:
            return
        self._params.update({k: str(v) for k, v in flatten(config_as_dict(config)).items()})

    def log_artifact(self, path: str | os.PathLike[str]) -> None:
        """Upload a file (a checkpoint, a figure) or folder to the run's artifacts."""
        self._refuse_after_finalize("log_artifact")
        if not self._logs():
            return
        self._artifacts.append(os.fspath(path))
        self.flush()

    def flush(self) -> None:
        """Send what is buffered; if the server does not answer, keep it for the next flush."""
        if self._logs():
            self._flush_now()

    def _flush_now(self) -> None:
        if not (self._metrics or self._params or self._artifacts):
            return
        try:
            self._send()
        except Exception as error:  # the dashboard being down must never stop the training
            if not self._warned:
                self._warned = True
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warn_user(f"MLflowLogger could not reach the tracking server {self._uri()!r} ({first_line[:200]}):"
                          " training goes on and the values are kept until it answers.")

    def _uri(self) -> str:
        return self._tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "./mlruns")

    def _send(self) -> None:
        from mlflow.entities import Metric, Param

        client = self._open()
        if self._params:
            client.log_batch(self._run_id, params=[Param(k, v) for k, v in self._params.items()])
            self._params.clear()
        while self._metrics:
            batch, rest = self._metrics[:1000], self._metrics[1000:]  # MLflow takes 1000 metrics a batch
            client.log_batch(self._run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in batch])
            self._metrics = rest
        while self._artifacts:
            path = self._artifacts[0]
            (client.log_artifacts if os.path.isdir(path) else client.log_artifact)(self._run_id, path)
            self._artifacts.pop(0)
        self._warned = False  # the server answers again: a later outage is worth a new warning

    def _open(self) -> Any:
        """The client, with this job's run created or reopened (rank 0 only)."""
        if self._client is None:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(self._request_timeout))
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self._tracking_uri)
        if self._opened_run_id is None:
            if self._run_id is None:
                self._run_id = self._job_run()
            if self._run_id is None:
                self._run_id = self._create_run()
            else:
                self._reopen_run()
            self._opened_run_id = self._run_id
        return self._client

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self._experiment_name)
        return str(experiment.experiment_id if experiment is not None
                   else self._client.create_experiment(self._experiment_name))

    def _job_run(self) -> str | None:
        """The run another process of this job opened (tagged `lite.job`), if `LITE_JOB_ID` is set."""
        key = job_run_key()
        if key is None:
            return None
        self._tags.setdefault(_JOB_TAG, key)
        runs = self._client.search_runs([self._experiment_id()], filter_string=f"tags.`{_JOB_TAG}` = '{key}'",
                                        order_by=["attributes.start_time ASC"], max_results=1)
        return str(runs[0].info.run_id) if runs else None

    def _create_run(self) -> str:
        run = self._client.create_run(self._experiment_id(), run_name=self._run_name, tags=self._tags)
        return str(run.info.run_id)

    def _reopen_run(self) -> None:
        """Mark the saved run running again, and skip the steps it already holds (those the
        interrupted job logged after its last checkpoint)."""
        self._client.update_run(self._run_id, status="RUNNING")
        metrics = self._client.get_run(self._run_id).data.metrics
        held = [m.step for key in metrics for m in self._client.get_metric_history(self._run_id, key)]
        self._resumed_at(max(held, default=-1))
        self._metrics = [m for m in self._metrics if m[3] > self._skip_through]

    def finalize(self) -> None:
        """Send everything buffered and mark the run finished; what the server cannot take is written
        to `fallback_dir`. Logging afterwards is refused, until Lite starts another `run()` with
        this logger, which reopens the same run."""
        super().finalize()

    def _close(self) -> None:
        if not self._logs():
            self._hand_over()
            self._params.clear()  # the config of a run that another process sends
            if self._metrics or self._artifacts:
                self._write_fallback()
            return
        self.flush()
        if self._metrics or self._params or self._artifacts:
            self._write_fallback()
        elif self._opened_run_id is not None:
            try:
                self._client.set_terminated(self._run_id, status="FINISHED")
            except Exception:  # the values are all sent; the run's status is only cosmetic
                pass
        self._opened_run_id = None

    def _hand_over(self) -> None:
        """Another process logs for the job now: forget the open run (it may come back to this one,
        reopened then, with the steps the other process logged skipped)."""
        if self._opened_run_id is not None and (self._metrics or self._artifacts):
            self._flush_now()  # what this process logged while it led
        self._opened_run_id = None

    def _persist(self) -> None:
        """Send what is buffered, so that the steps a checkpoint covers are on the server before it is
        written (while the server does not answer they stay buffered, see `flush`)."""
        self._flush_now()

    def _write_fallback(self) -> None:
        self._fallback_dir.mkdir(parents=True, exist_ok=True)
        path = self._fallback_dir / f"mlflow-unsent-{self._run_id or 'no-run'}.jsonl"
        with path.open("a") as handle:
            for key, value in self._params.items():
                handle.write(json.dumps({"param": key, "value": value}) + "\n")
            for key, value, timestamp, step in self._metrics:
                handle.write(json.dumps({"metric": key, "value": value, "timestamp": timestamp, "step": step}) + "\n")
            for artifact in self._artifacts:
                handle.write(json.dumps({"artifact": artifact}) + "\n")
        warn_user(f"MLflowLogger could not send {len(self._metrics)} metric values to {self._uri()!r}: they are in"
                  f" '{path}', one JSON object per line.")
        self._metrics, self._params, self._artifacts = [], {}, []
