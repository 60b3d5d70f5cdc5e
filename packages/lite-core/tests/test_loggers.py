"""The built-in loggers on one process: file layout, columns, steps, finalize, missing packages."""

from __future__ import annotations

import csv
import importlib.util
import signal
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
    for x in (1, 2, 3):
        logger.log_metrics({"x": x})
    assert not logger.path.exists()  # three rows buffered, the third step's may still grow
    logger.log_metrics({"x": 4})  # a new step begins: the three rows before it are written
    assert [r["x"] for r in read_csv(logger.path)[1]] == ["1", "2", "3"]
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
                               " `pip install 'tensorboard>=2.14'`.")
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


def test_values_logged_at_one_step_make_one_row_also_after_a_checkpoint_wrote_it(tmp_path: Path) -> None:
    class Job(LightningLite):
        def run(self) -> list[dict[str, str]]:
            for step in range(3):
                self.log("loss", 1.0 + step, step=step)
                self.log_dict({"lr": 0.5, "grad_norm": 2.0}, step=step)  # a second call at the same step
            self.save({"csv": logger}, tmp_path / "last.ckpt")
            written_by_the_save = read_csv(logger.path)[1]
            self.log("val_loss", 0.25, step=2)  # after the save, at the step it covers
            return written_by_the_save

    logger = CSVLogger(tmp_path, flush_every=100)
    written_by_the_save = Job(accelerator="cpu", loggers=logger).run()
    assert [r["step"] for r in written_by_the_save] == ["0", "1", "2"]  # the checkpoint's rows are on disk
    columns, rows = read_csv(logger.path)
    assert columns == ["step", "loss", "lr", "grad_norm", "val_loss"]
    assert rows == [{"step": str(s), "loss": str(1.0 + s), "lr": "0.5", "grad_norm": "2.0",
                     "val_loss": "0.25" if s == 2 else ""} for s in range(3)]


def test_a_resumed_csv_logger_continues_its_folder_without_the_rows_after_the_checkpoint(tmp_path: Path) -> None:
    class Job(LightningLite):
        def run(self, attempt: int, steps: range) -> None:
            state = {"step": 0, "csv": logger}
            self.load(tmp_path / "last.ckpt", state, missing_ok=True)
            for step in range(state["step"], steps.stop):
                self.log("value", step + 100.0 * attempt, step=step)
                if attempt == 0:  # a value the resumed job no longer logs
                    self.log("lr", 0.5, step=step)
                if step == 3:
                    state["step"] = step + 1
                    self.save(state, tmp_path / "last.ckpt")

    for attempt, steps in enumerate((range(6), range(8))):  # the first attempt wrote steps 4 and 5 after its checkpoint
        logger = CSVLogger(tmp_path)
        Job(accelerator="cpu", loggers=logger).run(attempt, steps)
    assert [p.name for p in (tmp_path / "lite_logs").iterdir()] == ["version_0"]  # one run per job
    rows = read_csv(tmp_path / "lite_logs" / "version_0" / "metrics.csv")[1]
    assert [(r["step"], r["value"], r["lr"]) for r in rows] == [  # the first attempt's rows 4 and 5 went whole
        (str(s), str(s + 100.0), "") if s > 3 else (str(s), str(float(s)), "0.5") for s in range(8)]


def test_a_logged_csv_logger_refuses_to_load_another_folder(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize()
    with pytest.raises(MisuseError, match=r"^CSVLogger already wrote into '.*version_0' before loading the checkpoint"
                                          r" of '.*version_7': call self.load\(...\) before the first log"):
        logger.load_state_dict({"version": "version_7", "last_step": 3})


def _killed_after_a_checkpoint_and_resumed(run_script, output_of, tmp_path: Path, logger: str) -> None:
    """Run kill_after_checkpoint.py with `logger` until it is killed, two steps after its checkpoint
    at step 10; then again, resuming from that checkpoint to its end."""
    killed = run_script("kill_after_checkpoint.py", str(tmp_path), logger)
    assert killed.returncode == -signal.SIGKILL, output_of(killed)
    resumed = run_script("kill_after_checkpoint.py", str(tmp_path), logger)
    assert resumed.returncode == 0, output_of(resumed)


def test_a_job_killed_after_a_checkpoint_resumes_its_csv_folder_with_each_step_once(run_script, output_of,
                                                                                       tmp_path: Path) -> None:
    _killed_after_a_checkpoint_and_resumed(run_script, output_of, tmp_path, "csv")
    assert [p.name for p in (tmp_path / "csv" / "lite_logs").iterdir()] == ["version_0"]  # one run per job
    columns, rows = read_csv(tmp_path / "csv" / "lite_logs" / "version_0" / "metrics.csv")
    assert columns == ["step", "value", "attempt"]  # one row per step: `attempt` was a second call
    attempts = [0 if step <= 10 else 1 for step in range(16)]  # the checkpoint's steps, then the resumed job's
    assert [(int(r["step"]), float(r["value"]), float(r["attempt"])) for r in rows] == [
        (step, step + 1000.0 * attempt, attempt) for step, attempt in zip(range(16), attempts)]


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """The (step, value) points TensorBoard shows for `tag` in `folder` (every event file, in order,
    with what a later writer's `purge_step` hides left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@needs_tensorboard
def test_a_job_killed_after_a_checkpoint_resumes_its_tensorboard_folder_with_each_step_once(run_script, output_of,
                                                                                              tmp_path: Path) -> None:
    _killed_after_a_checkpoint_and_resumed(run_script, output_of, tmp_path, "tensorboard")
    folders = list((tmp_path / "tb" / "lite_logs").iterdir())
    assert [p.name for p in folders] == ["version_0"]  # one run per job
    attempts = [0 if step <= 10 else 1 for step in range(16)]  # the checkpoint's steps, then the resumed job's
    assert tensorboard_scalars(folders[0], "value") == [(s, s + 1000.0 * a) for s, a in zip(range(16), attempts)]
    assert tensorboard_scalars(folders[0], "attempt") == [(s, float(a)) for s, a in zip(range(16), attempts)]


@needs_tensorboard
def test_a_resumed_tensorboard_logger_hides_what_was_written_after_the_checkpoint(tmp_path: Path) -> None:
    class Job(LightningLite):
        def run(self, attempt: int) -> None:
            state = {"step": 0, "tb": logger}
            self.load(tmp_path / "last.ckpt", state, missing_ok=True)
            for step in range(state["step"], 6):
                self.log("value", step + 100.0 * attempt, step=step)
                if step == 3:
                    state["step"] = step + 1
                    self.save(state, tmp_path / "last.ckpt")

    for attempt in (0, 1):  # the first attempt wrote steps 4 and 5 after its checkpoint
        logger = TensorBoardLogger(tmp_path)
        Job(accelerator="cpu", loggers=logger).run(attempt)
    folders = list((tmp_path / "lite_logs").iterdir())
    assert [p.name for p in folders] == ["version_0"]  # one run per job
    assert tensorboard_scalars(folders[0], "value") == [(s, s + (100.0 if s > 3 else 0.0)) for s in range(6)]
