"""`CSVLogger`: metrics as rows of a CSV file that any spreadsheet or `csv` reader opens."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lite_core.loggers.logger import FolderLogger


class CSVLogger(FolderLogger):
    """Writes `root_dir/name/version_N/metrics.csv`, one row per step.

    The first column is `step`; the other columns are the metric names in the order they first
    appear (a row leaves the metrics it did not log empty). Values logged at one step, in one call
    or several, make one row. Nothing is created until the first value is logged, so constructing
    it on every rank is fine; Lite logs from rank 0 only.

    Put the logger in the state you save (`self.save({"model": model, "csv": logger}, path)`): the
    rows buffered so far are written before the checkpoint is, and a job resumed from it writes
    into the same `version_N` folder, without the rows the interrupted job wrote after the
    checkpoint's step (the resumed job logs those steps again), so each step is in the file once.

    Args:
        root_dir: the folder that holds every run's logs.
        name: a subfolder for this experiment.
        version: `version_N` subfolder number, or a folder name; `None` picks the next free number
            (a loaded checkpoint's folder replaces it).
        flush_every: write buffered rows to disk once this many steps' rows are buffered (when the
            next step begins), and always at a `save` of a state holding the logger and in
            `finalize()`.
    """

    def __init__(self, root_dir: str | os.PathLike[str], name: str = "lite_logs", version: int | str | None = None,
                 flush_every: int = 100) -> None:
        super().__init__(root_dir, name, version)
        self._flush_every = flush_every
        self._columns: list[str] = []
        self._written_columns: list[str] = []
        self._pending: dict[int, dict[str, Any]] = {}  # the buffered rows by step, in the order steps came
        self._on_disk: set[int] = set()  # the steps of the rows in the file, as far as this logger knows
        self._drop_after: int | None = None  # a resumed job's checkpoint step: later rows in the file go

    @property
    def path(self) -> Path:
        """The CSV file."""
        return self.log_dir / "metrics.csv"

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Add `metrics` to the row of `step`; when a new step begins with `flush_every` rows
        buffered, write them."""
        step = self._step_to_log(step)
        if step is None:
            return
        if step not in self._pending and len(self._pending) >= self._flush_every:
            self.flush()
        row = self._pending.setdefault(step, {"step": step})
        row.update(metrics)
        self._columns.extend(key for key in row if key not in self._columns)

    def flush(self) -> None:
        """Write the buffered rows: appended, or the file rewritten when new columns appeared, a
        buffered step already has a row there, or a resumed job drops the rows after its checkpoint."""
        if not self._pending and (self._drop_after is None or not self.path.exists()):
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._wrote = True
        if self._needs_rewrite():
            self._rewrite()
        else:
            with self.path.open("a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=self._columns).writerows(self._pending.values())
        self._on_disk.update(self._pending)
        self._pending.clear()

    def _needs_rewrite(self) -> bool:
        return (self._columns != self._written_columns or self._drop_after is not None
                or not self._on_disk.isdisjoint(self._pending))

    def _rewrite(self) -> None:
        """Write the file anew: its rows (possibly from another logger writing this version) less
        those a resume drops, with the buffered values merged into the rows of their steps."""
        rows, known = _read_rows(self.path)
        if self._drop_after is not None:
            rows = [row for row in rows if not _step_after(row, self._drop_after)]
        by_step = {row["step"]: row for row in rows}
        for step, values in self._pending.items():
            row = by_step.get(str(step))
            if row is None:
                rows.append(values)
                by_step[str(step)] = values
            else:
                row.update(values)
        self._columns = known + [c for c in self._columns if c not in known]
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(partial, self.path)
        self._written_columns = list(self._columns)
        self._on_disk = {int(step) for step in by_step if str(step).lstrip("-").isdigit()}
        self._drop_after = None

    def _persist(self) -> None:
        self.flush()

    def _resume(self, last_step: int) -> None:
        self._drop_after = last_step
        self._on_disk.clear()
        self._written_columns = []  # the file is read again at the first write

    def finalize(self) -> None:
        """Write everything still buffered."""
        self.flush()


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows and the columns of the CSV file at `path` (none when it does not exist)."""
    if not path.exists():
        return [], []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows: list[dict[str, Any]] = list(reader)
    return rows, list(reader.fieldnames or [])


def _step_after(row: Mapping[str, Any], step: int) -> bool:
    """Whether `row` is of a step after `step`."""
    value = str(row.get("step", ""))
    return value.lstrip("-").isdigit() and int(value) > step
