"""What the tracker loggers (`WandbLogger`, `MLflowLogger`, `TrackioLogger`) share: one run per job
opened lazily on the logging process (global rank 0), the run id and last logged step as
checkpointable state, the job's key (`LITE_JOB_ID`) that lets several processes find one run, the
user's config as flat or nested hyperparameters."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

from lite_core.errors import MisuseError, MissingDependencyError
from lite_core._install import install_hint


def require_package(module: str, logger: str, extra: str) -> None:
    """Raise `MissingDependencyError` naming the `pip install` when `module` is not installed
    (checked without importing it: the client is imported on global rank 0 at the first log)."""
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"{logger} needs the {module} package, which is not installed: run `{install_hint(extra)}`."
        )


def global_rank() -> int:
    """This process's global rank: the process group's when one is set up, else `RANK` (0 alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


#: A key shared by every process of one job, across restarts of its processes: with it the tracker
#: loggers of several processes that may each come to log (the replica groups of `ddp_ft`) find one
#: run. `lite run --replica-groups` exports one; you may set your own.
JOB_ID_VARIABLE = "LITE_JOB_ID"


def job_run_key() -> str | None:
    """The run key of this job (`lite-` and 16 hex digits of `LITE_JOB_ID`'s hash, a valid W&B id
    and trackio name), or `None` when `LITE_JOB_ID` is not set."""
    job_id = os.environ.get(JOB_ID_VARIABLE)
    if not job_id:
        return None
    return "lite-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


def config_as_dict(config: Any) -> dict[str, Any]:
    """The user's config as a dict: a mapping, a dataclass instance or an `argparse.Namespace`."""
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, argparse.Namespace):
        return vars(config).copy()
    raise MisuseError(
        f"log_hyperparams takes a dict, a dataclass instance or an argparse.Namespace, not a"
        f" {type(config).__name__}: pass one of those."
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys: `{"opt": {"lr": 1}}` -> `{"opt.lr": 1}`."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


class TrackerLogger:
    """Shared base: the run id and last step (`state_dict`), steps a resume repeats skipped, every
    call a no-op off global rank 0 (no client import, no run), and logging after `finalize` refused."""

    _name = "TrackerLogger"

    def __init__(self) -> None:
        self._logging_process: Callable[[], bool] = lambda: global_rank() == 0
        self._logging_round: Callable[[], int | None] = lambda: None
        # step -> (round, values): logged off the logging process in that round (see `_keep_unsent`);
        # round None: loaded from a checkpoint, in the first round this process logs in
        self._unsent: dict[int, tuple[int | None, dict[str, Any]]] = {}
        self._run_id: str | None = None
        self._last_step = -1
        self._skip_through = -1  # steps up to this one were logged before a resume: not again
        self._opened_run_id: str | None = None  # the run this process has opened (rank 0)
        self._finalized = False

    def _follow(self, is_logging_process: Callable[[], bool],
                logging_round: Callable[[], int | None] = lambda: None) -> None:
        """Send (metrics, artifacts, the run) only where `is_logging_process()` says: `LightningLite`
        passes its strategy's choice (global rank 0, or one replica group's rank 0), and
        `logging_round()`, the id of that choice where it may move (see `_keep_unsent`)."""
        self._logging_process = is_logging_process
        self._logging_round = logging_round

    def _keep_unsent(self, metrics: Mapping[str, Any], step: int | None) -> None:
        """Off the logging process, where the logging may move to this one (`logging_round()` is
        not `None`, rank 0 of its replica group): keep the values logged since the round began.
        A later round's logging process was alive when that round began, so what an earlier round
        kept is dropped then; if the logging comes here instead, `_take_unsent` gives them back,
        and they fill the steps its dead predecessor logged but never stored."""
        current = self._logging_round()
        if current is None or step is None or global_rank() != 0:
            return
        self._unsent = {kept: (current, values) for kept, (round_, values) in self._unsent.items()
                        if round_ is None or round_ == current}
        values = {name: value.item() if hasattr(value, "item") else value for name, value in metrics.items()}
        self._unsent.setdefault(int(step), (current, {}))[1].update(values)

    def _kept(self) -> dict[int, dict[str, Any]]:
        """What `_keep_unsent` holds, by step: a peer that heals from this process takes it."""
        return {step: dict(values) for step, (_, values) in self._unsent.items()}

    def _take_kept(self, kept: Mapping[int, Mapping[str, Any]]) -> None:
        """A peer's kept values, taken in a heal: this process may have healed past steps it never
        trained (its group resumed behind a sync the peer had passed), and if the logging comes here
        it sends those the tracker lacks. Kept as restored values are, through the first round this
        process logs in; a step it logged itself keeps its own values."""
        for step, values in kept.items():
            self._unsent.setdefault(int(step), (None, dict(values)))

    def _take_unsent(self, before: int | None) -> list[tuple[int, dict[str, Any]]]:
        """The values `_keep_unsent` kept for steps before `before` (all, for `None`) that the
        tracker does not hold yet, in step order, each step counted as logged; the rest is dropped.
        Call it on the logging process, once the run is open (so its held steps are known)."""
        kept, self._unsent = self._unsent, {}
        steps = sorted(step for step in kept if before is None or step < before)
        return [(step, kept[step][1]) for step in steps if self._next_step(step) is not None]

    def _logs(self) -> bool:
        """Whether this process sends to the tracker now."""
        return self._logging_process()

    def _open(self) -> Any:
        """The tracker's run (or client) of this job, opened on first use (each tracker's own)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Close the run this process has open, if any (each tracker's own)."""
        raise NotImplementedError

    def finalize(self) -> None:
        """Close the run (Lite calls this when `run()` returns or fails); logging afterwards is
        refused, until Lite starts another `run()` with this logger, which continues the run."""
        self._close()
        self._finalized = True

    def _reopen(self) -> None:
        """Lite starts another `run()` with this logger: it may log again, into the same run."""
        self._finalized = False

    def _refuse_after_finalize(self, call: str) -> None:
        if self._finalized:
            raise MisuseError(
                f"{self._name}.{call} was called after finalize(), which finished the run: log before run()"
                " returns (Lite finalizes its loggers then), or start another run() to continue the run."
            )

    def _log_to_run(self, metrics: Mapping[str, Any], step: int | None) -> None:
        """`log_metrics` for a tracker whose run (from `self._open()`) has `log(dict, step=...)`
        (W&B, trackio): sent from the logging process only, each step once."""
        self._refuse_after_finalize("log_metrics")
        if not self._logs():
            self._keep_unsent(metrics, step)
            self._hand_over()
            return
        run = self._open()
        for early, values in self._take_unsent(None if step is None else int(step)):
            run.log(values, step=early)
        step = self._next_step(step)
        if step is not None:
            run.log(dict(metrics), step=step)

    def _hand_over(self) -> None:
        """Another process logs for the job now: close the run this process has open (the other one
        continues it; this one reopens it if the logging comes back)."""
        self._close()

    @property
    def run_id(self) -> str | None:
        """The tracker's id of this job's run (`None` until it is opened, or restored by `load`)."""
        return self._run_id

    def state_dict(self) -> dict[str, Any]:
        """`{"run_id": ..., "last_step": ...}`, taken once what was logged has reached the tracker's
        own storage (see `_persist`), so that a process killed right after the checkpoint loses no
        step the checkpoint covers: put the logger in the state you `save`, and `load` makes the
        resumed job append to the same tracker run. Off the logging process it also holds, as
        `"unsent"`, the values `_keep_unsent` kept (where there are any), so that a replica group
        restarted from it can still give them to the tracker if the logging comes to it."""
        if self._logs():
            self._persist()
        state: dict[str, Any] = {"run_id": self._run_id, "last_step": self._last_step}
        if self._unsent:
            state["unsent"] = {step: dict(values) for step, (_, values) in self._unsent.items()}
        return state

    def _persist(self) -> None:
        """The durable point (each tracker's own): what was logged is in the tracker's own storage
        when this returns; `save` takes the logger's state, and so calls it, before it writes."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved run: later logs go to `state["run_id"]`, and the steps up to
        `state["last_step"]` that the resumed job repeats are not logged again (nor those the
        tracker reports it already holds, where it can tell, see `_tracker_last_step`)."""
        run_id = state.get("run_id")
        if self._opened_run_id is not None and run_id != self._opened_run_id:
            raise MisuseError(
                f"{self._name} already opened run {self._opened_run_id!r} before loading the checkpoint of run"
                f" {run_id!r}: call self.load(...) before the first log so that the job continues its run."
            )
        self._run_id = run_id
        self._last_step = max(self._last_step, int(state.get("last_step", -1)))
        unsent = state.get("unsent") or {}
        if unsent:  # kept through the first round this process logs in (its strategy's state may load later)
            self._unsent = {int(step): (None, dict(values)) for step, values in unsent.items()}
        self._skip_through = max(self._skip_through, self._last_step)

    def _next_step(self, step: int | None) -> int | None:
        """The step to log, or `None` when a resume repeats a step that was logged before it (several
        calls for one step are fine: only steps at or below the resume point are skipped)."""
        step = self._last_step + 1 if step is None else int(step)
        if step <= self._skip_through:
            return None
        self._last_step = max(self._last_step, step)
        return step

    def _resumed_at(self, tracker_last_step: int) -> None:
        """The reopened run already holds steps up to `tracker_last_step` (logged after the
        checkpoint by the job that was interrupted): skip those too."""
        self._skip_through = max(self._skip_through, tracker_last_step)
        self._last_step = max(self._last_step, tracker_last_step)
