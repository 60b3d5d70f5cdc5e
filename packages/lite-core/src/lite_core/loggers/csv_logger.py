"""`CSVLogger`: metrics as rows of a CSV file that any spreadsheet or `csv` reader opens."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lite_core.loggers.logger import FolderLogger


class CSVLogger(FolderLogger):
    """Writes `root_dir/name/version_N/metrics.csv`, one row per `log_metrics` call.

    The first column is `step`; the other columns are the metric names in the order they first
    appear (a row leaves the metrics it did not log empty). Nothing is created until the first
    value is logged, so constructing it on every rank is fine; Lite logs from rank 0 only.

    Args:
        root_dir: the folder that holds every run's logs.
        name: a subfolder for this experiment.
        version: `version_N` subfolder number, or a folder name; `None` picks the next free number.
        flush_every: write buffered rows to disk after this many `log_metrics` calls (and always in
            `finalize()`).
    """

    def __init__(self, root_dir: str | os.PathLike[str], name: str = "lite_logs", version: int | str | None = None,
                 flush_every: int = 100) -> None:
        super().__init__(root_dir, name, version)
        self._flush_every = flush_every
        self._columns: list[str] = []
        self._written_columns: list[str] = []
        self._pending: list[dict[str, Any]] = []

    @property
    def path(self) -> Path:
        """The CSV file."""
        return self.log_dir / "metrics.csv"

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Buffer one row; write the buffer every `flush_every` rows."""
        row = {"step": self._steps.step(step), **metrics}
        self._columns.extend(key for key in row if key not in self._columns)
        self._pending.append(row)
        if len(self._pending) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows (rewriting the file when new columns appeared)."""
        if not self._pending:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._columns != self._written_columns:
            self._rewrite_with_new_columns()
        else:
            with self.path.open("a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=self._columns).writerows(self._pending)
        self._pending.clear()

    def _rewrite_with_new_columns(self) -> None:
        rows: list[dict[str, Any]] = []
        if self.path.exists():  # earlier rows, possibly from another logger writing this version
            with self.path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                rows = list(reader)
            known = list(reader.fieldnames or [])
            self._columns = known + [c for c in self._columns if c not in known]
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(rows + self._pending)
        os.replace(partial, self.path)
        self._written_columns = list(self._columns)

    def finalize(self) -> None:
        """Write everything still buffered."""
        self.flush()
