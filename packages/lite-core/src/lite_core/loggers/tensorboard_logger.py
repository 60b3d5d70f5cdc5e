"""`TensorBoardLogger`: metrics as TensorBoard scalars, through `torch.utils.tensorboard`."""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Mapping
from typing import Any

from lite_core.errors import MisuseError, MissingDependencyError
from lite_core.loggers.logger import FolderLogger
from lite_core._install import install_hint


class TensorBoardLogger(FolderLogger):
    """Writes TensorBoard event files into `root_dir/name/version_N/`; view them with
    `tensorboard --logdir root_dir`.

    Needs the `tensorboard` package (`pip install 'lite-core[tensorboard]'`). Nothing is created
    until the first value is logged; Lite logs from rank 0 only.

    Put the logger in the state you save (`self.save({"model": model, "tb": logger}, path)`): the
    event file is flushed before the checkpoint is written, and a job resumed from it writes into
    the same `version_N` folder, with TensorBoard told to hide what the interrupted job wrote after
    the checkpoint's step (`SummaryWriter(purge_step=...)`), so each step shows once.

    Args:
        root_dir: the folder that holds every run's logs.
        name: a subfolder for this experiment.
        version: `version_N` subfolder number, or a folder name; `None` picks the next free number.
        **writer_kwargs: passed on to `torch.utils.tensorboard.SummaryWriter` (e.g. `flush_secs`).

    Raises:
        MissingDependencyError: `tensorboard` is not installed.
    """

    def __init__(self, root_dir: str | os.PathLike[str], name: str = "lite_logs", version: int | str | None = None,
                 **writer_kwargs: Any) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise MissingDependencyError(
                "TensorBoardLogger needs the tensorboard package, which is not installed: run"
                f" `{install_hint('tensorboard')}`."
            )
        super().__init__(root_dir, name, version)
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None
        self._purge_from: int | None = None  # the first step after a loaded checkpoint's

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Add each metric as a scalar at `step`."""
        step = self._step_to_log(step)
        if step is None:
            return
        writer = self._open()
        for name, value in metrics.items():
            if not isinstance(value, numbers.Real):
                raise MisuseError(
                    f"TensorBoardLogger logs numbers but {name!r} is a {type(value).__name__}: log a float or a"
                    " one-element tensor."
                )
            writer.add_scalar(name, float(value), global_step=step)

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            kwargs = dict(self._writer_kwargs)
            if self._purge_from is not None:  # TensorBoard hides what the interrupted job wrote from there on
                kwargs.setdefault("purge_step", self._purge_from)
                self._purge_from = None
            self._writer = SummaryWriter(log_dir=str(self.log_dir), **kwargs)
            self._wrote = True
        return self._writer

    def _persist(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _resume(self, last_step: int) -> None:
        self._purge_from = last_step + 1

    def finalize(self) -> None:
        """Flush and close the event file; logging again opens a new one in the same folder."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
