"""What a new user trips on moving a small loop to `fsdp` on 2 processes and back to one
(`tests/scripts/new_user_trips.py`, run under `python` and under `lite run`, with its output on
pipes, as in CI or a scheduler's log):

- `measure_flops(model, x)` after `setup()` under `fsdp` counts what it counts before setup (it
  raised torch's raw "FSDP does not support deepcopy");
- loading a checkpoint into a model with other keys raises one `CheckpointError` sentence naming
  the model's class, how many keys differ and the first few (it raised torch's raw errors: a
  `RuntimeError` listing every key, or a `CheckpointException` with a traceback for sharded ones);
- resuming per-rank batches on another number of processes warns once at `load`, naming
  `split_batches=True`, and `split_batches=True` resumes without a word;
- `progress_bar` prints plain lines when its output is not a terminal (it printed nothing), on
  rank 0 only.

Two launches per launcher: `fsdp` on 2 processes, then `resume` on one.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

# Hang guard: each launcher's two runs take about 10 s (python) and 20 s (lite run) on an idle
# 2-core machine; 240 s is over 10x that (the fixture's runs count against its first test).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _launch(run_script, launcher: str, devices: int, *args: object):  # type: ignore[no-untyped-def]
    if launcher == "python":
        return run_script("new_user_trips.py", *args)
    command = [sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", str(devices),
               "new_user_trips.py", *map(str, args)]
    return run_script(command=command)


@pytest.fixture(scope="module", params=["python", "lite run"])
def runs(request, run_script, output_of, tmp_path_factory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("trips")
    on_fsdp = _launch(run_script, request.param, 2, "fsdp", out)
    assert on_fsdp.returncode == 0, output_of(on_fsdp)
    resumed = _launch(run_script, request.param, 1, "resume", out)
    assert resumed.returncode == 0, output_of(resumed)
    ranks = [json.loads((out / f"fsdp-rank{rank}.json").read_text()) for rank in (0, 1)]
    resume = json.loads((out / "resume.json").read_text())
    return {"fsdp": on_fsdp, "ranks": ranks, "resumed": resumed, "resume": resume}


def test_measure_flops_after_setup_under_fsdp_counts_the_whole_model(runs) -> None:  # type: ignore[no-untyped-def]
    for record in runs["ranks"]:
        assert record["set_up_flops"] == record["plain_flops"] == record["expected_flops"], record
        assert record["trains_after_counting"]


def _one_sentence_about_keys(message: str) -> None:
    assert message.startswith("CheckpointError: The checkpoint's weights do not fit this TinyNet: 8 keys differ"
                              " (6 missing from the checkpoint, among them 'blocks.2.up.weight', 'blocks.2.up.bias',"
                              " 'blocks.2.down.weight'; 2 unexpected: "), message
    assert "'head.weight'" in message and "'head.bias'" in message
    assert message.endswith("or pass strict=False to load only the keys that match.")
    assert ". " not in message.removeprefix("CheckpointError: "), f"not one sentence: {message}"


@pytest.mark.parametrize("case", ["sharded_into_other", "file_into_other"])
def test_loading_a_checkpoint_into_another_model_is_one_checkpoint_error(runs, case):  # type: ignore[no-untyped-def]
    for record in runs["ranks"]:
        _one_sentence_about_keys(record[case])
    if case == "file_into_other":  # and on one process, where the model loads the file itself
        _one_sentence_about_keys(runs["resume"][case])


def test_per_rank_batches_resumed_on_one_process_warn_once_naming_split_batches(runs):  # type: ignore[no-untyped-def]
    per_rank = runs["resume"]["per_rank"]
    [warning] = per_rank["warnings"]  # once: at load, not again in the epoch that follows
    assert "saved on 2 processes taking 8 samples per step, and resumes on 1 taking 4" in warning
    assert "split_batches=True" in warning
    assert per_rank["warned_at"] == ["new_user_trips.py"]  # the user's line that called load
    assert per_rank["batches"] == 4  # the 16 samples left of the epoch, 4 per step


def test_split_batches_resumed_on_one_process_say_nothing(runs) -> None:  # type: ignore[no-untyped-def]
    split = runs["resume"]["split"]
    assert split["warnings"] == []
    assert split["batches"] == 2  # the same global batch of 8 as on 2 processes


def _progress_lines(stderr: str, desc: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{desc}:")]


def test_progress_bar_prints_plain_lines_when_its_output_is_a_pipe(runs) -> None:  # type: ignore[no-untyped-def]
    # 40 iterations: a line at the start and every 2 (1/20 of them): 21 lines, from rank 0 only.
    lines = _progress_lines(runs["fsdp"].stderr, "fsdp epoch")
    assert [re.search(r" (\d+)/40 ", line).group(1) for line in lines] == [str(n) for n in range(0, 41, 2)], lines
    assert all("\r" not in line and "\x1b" not in line for line in lines)
    resumed = _progress_lines(runs["resumed"].stderr, "resumed per_rank")
    assert [re.search(r" (\d)/4 ", line).group(1) for line in resumed] == ["0", "1", "2", "3", "4"], resumed
