"""Loggers, callbacks and the progress bar in a real 2-process ddp job."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, run_script, output_of
        ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out_dir = tmp_path_factory.mktemp("logging_job")
    proc = run_script("logging_job.py", out_dir)
    assert proc.returncode == 0, output_of(proc)
    return out_dir, proc


def test_only_rank_zero_writes_log_files(job):
    out_dir, _ = job
    files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())
    logs = [f for f in files if f.startswith(("csv", "tb"))]
    assert logs[0] == "csv/job/version_0/metrics.csv" and len(logs) == 2, files
    assert logs[1].startswith("tb/job/version_0/events.out.tfevents."), files


def test_csv_reader_reads_back_rank_zero_values(job):
    out_dir, _ = job
    with (out_dir / "csv/job/version_0/metrics.csv").open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames == ["step", "loss", "lr", "val_acc"]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]  # one row per step: val_acc joins step 3's
    assert [float(r["loss"]) for r in rows if r["loss"]] == [0.0, 1.0, 2.0, 3.0, 4.0]  # rank 0's, not 10 + step
    assert {float(r["lr"]) for r in rows if r["lr"]} == {0.1}
    assert [float(r["val_acc"]) for r in rows if r["val_acc"]] == [0.5]


def test_tensorboard_reader_reads_back_rank_zero_values(job):
    out_dir, _ = job
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # only `test` has it

    accumulator = EventAccumulator(str(out_dir / "tb/job/version_0"))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["loss", "lr", "val_acc"]
    loss = accumulator.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4]
    assert [e.value for e in loss] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [(e.step, e.value) for e in accumulator.Scalars("val_acc")] == [(3, 0.5)]


def test_loggers_are_flushed_when_run_returns(job):
    out_dir, _ = job
    # flush_every=1000 and TensorBoard's 120 s flush interval: only finalize() can have written these.
    after = json.loads((out_dir / "after_run_rank0.json").read_text())
    assert after["csv"] is not None and len(after["csv"].splitlines()) == 6  # header + a row per step
    assert after["event_bytes"] > 0
    assert after["event_bytes"] == sum(p.stat().st_size for p in (out_dir / "tb").rglob("events.out.tfevents.*"))


def test_callbacks_run_on_every_rank_with_their_arguments(job):
    out_dir, _ = job
    for rank in (0, 1):
        calls = [json.loads(line) for line in (out_dir / f"callbacks_rank{rank}.jsonl").read_text().splitlines()]
        assert calls == [{"rank": rank, "step": s, "value": 10.0 * rank + s} for s in range(5)]


def test_progress_bar_prints_plain_lines_on_rank_zero_only_when_output_is_not_a_terminal(job):
    _, proc = job
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bar-rank0:")]
    assert [line.split(" [")[0].split()[-1] for line in lines] == [f"{n}/5" for n in range(6)], proc.stderr
    assert "bar-rank1" not in proc.stderr and "bar-rank" not in proc.stdout


def run_on_a_terminal(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `command` with stdout and stderr on a pseudo-terminal; return its code and output."""
    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sub_fd, stderr=sub_fd, env=env,
                            cwd=SCRIPTS, start_new_session=True)
    os.close(sub_fd)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main_fd, 4096)
            except OSError:  # EIO: every process holding the terminal has exited
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    reader.join(timeout=10)
    os.close(main_fd)
    return code, b"".join(chunks).decode(errors="replace")


def test_progress_bar_shows_on_rank_zero_only_on_a_terminal(tmp_path, scripts_env):
    code, output = run_on_a_terminal([sys.executable, str(SCRIPTS / "logging_job.py"), str(tmp_path)], scripts_env())
    assert code == 0, output
    assert "bar-rank0" in output and "5/5" in output
    assert "bar-rank1" not in output
