"""The user's callbacks and loggers as one `LightningLite` calls them: callbacks on every rank,
loggers on the logging process only (global rank 0, see `Strategy.is_logging_process`)."""

from __future__ import annotations

from typing import Any

import torch

from lite_core.loggers._tracker import TrackerLogger
from lite_core.strategies.strategy import Strategy


class Callbacks:
    """Objects whose methods `call(hook_name, ...)` invokes, where they define it."""

    def __init__(self, callbacks: list[Any]) -> None:
        self._callbacks = callbacks

    def call(self, hook_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if callable(method):
                method(*args, **kwargs)


class _KeptValues:
    """The values the tracker loggers keep off the logging process (`TrackerLogger._keep_unsent`),
    as one state a healing replica group takes from its peer (`Strategy.carry_in_heals`)."""

    def __init__(self, trackers: list[TrackerLogger]) -> None:
        self._trackers = trackers

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [tracker._kept() for tracker in self._trackers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for tracker, kept in zip(self._trackers, state["kept"]):
            tracker._take_kept(kept)


class Loggers:
    """The job's loggers: metrics logged from the logging process (tensors as numbers), closed at the end.

    The tracker loggers follow the strategy's choice of that process in what they send themselves
    (`log_artifact`, the run they open)."""

    def __init__(self, loggers: list[Any], strategy: Strategy) -> None:
        self._loggers = loggers
        self._strategy = strategy
        trackers = [logger for logger in loggers if isinstance(logger, TrackerLogger)]
        for logger in trackers:
            logger._follow(strategy.is_logging_process, strategy.logging_round)
        if trackers:
            strategy.carry_in_heals("loggers", _KeptValues(trackers))

    def log_dict(self, metrics: dict[str, Any], step: int | None) -> None:
        if not self._strategy.is_logging_process():
            for logger in self._loggers:
                if isinstance(logger, TrackerLogger):  # sends nothing here; closes a run it opened while it logged
                    logger.log_metrics(metrics, step=step)
            return
        metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(metrics, step=step)

    def log_hyperparams(self, config: Any) -> None:
        """Pass the user's config to every logger that has `log_hyperparams` (rank 0 only: under a
        strategy with replica groups, rank 0 of every group, whose tracker loggers keep it for the
        run they may take over)."""
        if self._strategy.global_rank != 0:
            return
        for logger in self._loggers:
            log_hyperparams = getattr(logger, "log_hyperparams", None)
            if callable(log_hyperparams):
                log_hyperparams(config)

    def begin(self) -> None:
        """A `run()` starts: tracker loggers finalized by an earlier one may log again (same run)."""
        for logger in self._loggers:
            if isinstance(logger, TrackerLogger):
                logger._reopen()

    def finalize(self) -> None:
        """Flush and close every logger that can be (file loggers reopen if the user logs again;
        tracker loggers refuse until the next `run()`)."""
        for logger in self._loggers:
            finalize = getattr(logger, "finalize", None)
            if callable(finalize):
                finalize()
