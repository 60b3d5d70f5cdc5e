"""The built-in loggers on one process: file layout, columns, steps, finalize, missing packages."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lite_core import CSVLogger, LightningLite, Logger, TensorBoardLogger
from lite_core.errors import MisuseError, MissingDependencyError


#: The TensorBoard tests need the optional package; the `test` environment has it, backend ones need not.
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="needs tensorboard (lite-core[tensorboard]), not installed in this environment (run it in `test`)",
)


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    return list(reader.fieldnames or []), rows


def test_csv_logger_satisfies_the_protocol(tmp_path: Path) -> None:
    assert isinstance(CSVLogger(tmp_path), Logger)


@needs_tensorboard
def test_tensorboard_logger_satisfies_the_protocol(tmp_path: Path) -> None:
    assert isinstance(TensorBoardLogger(tmp_path), Logger)


def test_csv_creates_nothing_before_the_first_value(tmp_path: Path) -> None:
    CSVLogger(tmp_path / "csv").finalize()
    assert list(tmp_path.iterdir()) == []


@needs_tensorboard
def test_tensorboard_creates_nothing_before_the_first_value(tmp_path: Path) -> None:
    TensorBoardLogger(tmp_path / "tb").finalize()
    assert list(tmp_path.iterdir()) == []


def test_csv_columns_grow_and_steps_count_on(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="exp", flush_every=1)
    logger.log_metrics({"loss": 1.5})
    logger.log_metrics({"loss": 1.0}, step=10)
    logger.log_metrics({"acc": 0.25})  # a new column: the file is rewritten with it
    logger.finalize()
    columns, rows = read_csv(tmp_path / "exp" / "version_0" / "metrics.csv")
    assert columns == ["step", "loss", "acc"]
    assert rows == [{"step": "0", "loss": "1.5", "acc": ""}, {"step": "10", "loss": "1.0", "acc": ""},
                    {"step": "11", "loss": "", "acc": "0.25"}]


def test_csv_rows_wait_for_flush_every_or_finalize(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_every=3)
    logger.log_metrics({"x": 1})
    logger.log_metrics({"x": 2})
    assert not logger.path.exists()
    logger.log_metrics({"x": 3})
    assert len(read_csv(logger.path)[1]) == 3
    logger.log_metrics({"x": 4})
    logger.finalize()
    logger.log_metrics({"x": 5})  # logging after finalize appends to the same file
    logger.finalize()
    assert [r["x"] for r in read_csv(logger.path)[1]] == ["1", "2", "3", "4", "5"]


def test_each_new_logger_takes_the_next_version(tmp_path: Path) -> None:
    for value in (1, 2):
        logger = CSVLogger(tmp_path, name="exp")
        logger.log_metrics({"x": value})
        logger.finalize()
    named = CSVLogger(tmp_path, name="exp", version="baseline")
    named.log_metrics({"x": 3})
    named.finalize()
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["baseline", "version_0", "version_1"]
    assert read_csv(tmp_path / "exp" / "version_1" / "metrics.csv")[1] == [{"step": "0", "x": "2"}]


def test_csv_logger_continues_a_version_written_before(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path, version=0)
    first.log_metrics({"a": 1})
    first.finalize()
    second = CSVLogger(tmp_path, version=0)
    second.log_metrics({"b": 2}, step=5)
    second.finalize()
    columns, rows = read_csv(second.path)
    assert columns == ["step", "a", "b"]
    assert rows == [{"step": "0", "a": "1", "b": ""}, {"step": "5", "a": "", "b": "2"}]


def test_lite_log_reaches_loggers_and_run_finalizes_them(tmp_path: Path) -> None:
    class Job(LightningLite):
        def run(self) -> bool:
            self.log("loss", torch.tensor(0.75), step=2)
            self.log_dict({"loss": 0.5, "acc": 1.0}, step=3)
            return logger.path.exists()

    logger = CSVLogger(tmp_path, flush_every=100)
    job = Job(accelerator="cpu", loggers=logger)
    existed_inside_run = job.run()
    assert not existed_inside_run  # buffered while running ...
    assert read_csv(logger.path)[1] == [{"step": "2", "loss": "0.75", "acc": ""},
                                        {"step": "3", "loss": "0.5", "acc": "1.0"}]  # ... flushed at the end


@needs_tensorboard
def test_tensorboard_rejects_values_that_are_not_numbers(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(MisuseError, match=r"^TensorBoardLogger logs numbers but 'name' is a str: log a float"):
        logger.log_metrics({"name": "abc"})
    logger.finalize()


def test_tensorboard_missing_names_the_install_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError) as info:
        TensorBoardLogger(tmp_path)
    assert str(info.value) == ("TensorBoardLogger needs the tensorboard package, which is not installed: run"
                               " `pip install 'lite-core[tensorboard]'`.")
    assert isinstance(info.value, ImportError)


@needs_tensorboard
def test_the_loggers_of_one_run_write_one_version_and_the_next_run_the_next(tmp_path: Path) -> None:
    class Job(LightningLite):
        def run(self) -> None:
            self.log("loss", 0.5, step=0)

    for _ in range(2):
        csv_logger, tensorboard = CSVLogger(tmp_path), TensorBoardLogger(tmp_path)
        Job(accelerator="cpu", loggers=[csv_logger, tensorboard]).run()
        assert csv_logger.log_dir == tensorboard.log_dir
    runs = tmp_path / "lite_logs"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    for version in ("version_0", "version_1"):
        assert (runs / version / "metrics.csv").exists() and list((runs / version).glob("events.out.tfevents.*"))
