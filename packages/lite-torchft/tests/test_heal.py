"""Two replica groups under `ddp_ft` on loopback: one is SIGKILLed mid-run and started again.

The test starts the lighthouse (in this process) and both groups itself (tests/scripts/ft_train.py,
one process each under `ddp_ft`, two under `fsdp_ft`; SIGKILL goes to the group's first process,
whose launcher takes its second one down). Group 0 must finish without a restart; both groups must end with bit-identical
weights, and with `setup_dataloaders(loader, split_batches=True)` (the user's own call, as under `ddp`)
equal to one plain PyTorch process over the same loader; an
evaluation pass afterwards, summed over a group's processes, equals the plain process's. The
`ThroughputMonitor`'s rows show the failure: the survivor's replica groups drop to one and come
back, and the restarted group's rows count its heal.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import free_port, killing_leftovers, script_env, start_life  # the repository's conftest.py

SCRIPT = Path(__file__).parent / "scripts" / "ft_train.py"

STEPS = 24  # ft_train.STEPS


def _start(group: int, lighthouse: str, out: Path, mode: str, log: Path) -> subprocess.Popen[str]:
    env = script_env(LITE_COLLECTIVE_TIMEOUT="10", REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FT_STEP_SLEEP="0.1",
                     TRACKIO_DIR=str(out / "trackio"), LITE_JOB_ID=f"heal-{out.name}")  # one job for both groups
    return start_life([sys.executable, str(SCRIPT), str(out), *mode.split()], env, stdout=log.open("a"),
                      stderr=subprocess.STDOUT)


def _committed(out: Path, group: int) -> int:
    progress = out / f"progress-{group}"
    return len(progress.read_text().splitlines()) if progress.exists() else 0


def _wait_for_step(out: Path, group: int, step: int, proc: subprocess.Popen[str], log: Path) -> None:
    _wait_for(lambda: _committed(out, group) >= step, proc, log)


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str], log: Path) -> None:
    # A hang guard. At 60 s a loaded fresh-clone CI run (2f34b85) once saw an fsdp_ft survivor log
    # nothing for a minute after committing step 5 (saving it to the bucket), cause not found.
    deadline = time.monotonic() + 150
    while not condition():
        assert proc.poll() is None, f"the group ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the group made no progress:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _open_the_gate_when_ready(out: Path, procs: list[subprocess.Popen[str]], logs: list[Path]) -> None:
    """Both groups wait at `OUT/gate` once set up (their Managers heartbeat): opened when both are
    ready, they meet the lighthouse together. Without it, a group that started seconds later on a
    busy machine found the other alone at the last step, and healed there."""
    for group, proc in enumerate(procs):
        _wait_for(lambda: any(out.glob(f"ready-{group}-{proc.life}")), proc, logs[group])
    (out / "gate").unlink()


def _hold(out: Path, group: int, at_step: int) -> None:
    """Group `group` waits between steps once it has committed `at_step`, until `hold-<group>` is removed."""
    part = out / f"hold-{group}.part"
    part.write_text(str(at_step))
    part.replace(out / f"hold-{group}")  # the group never reads a half-written file


def _kill_and_restart(lighthouse: str, out: Path, mode: str, victim: int = 1,
                      ready_to_kill: Callable[[], bool] | None = None) -> int:
    """Both groups run; `victim` is SIGKILLed after its step 5 and started again while the survivor
    goes on alone for three steps and then waits for it. With `ready_to_kill`, the victim waits
    after its step 5 until `ready_to_kill()` holds, and is killed there. Returns the step the
    survivor waited at."""
    survivor = 1 - victim
    logs = [out / "group-0.log", out / "group-1.log"]
    (out / "gate").touch()
    if ready_to_kill is not None:
        _hold(out, victim, 5)
    procs = [_start(g, lighthouse, out, mode, logs[g]) for g in (0, 1)]
    with killing_leftovers(procs):
        _open_the_gate_when_ready(out, procs, logs)
        _wait_for_step(out, victim, 5, procs[victim], logs[victim])
        if ready_to_kill is not None:
            _wait_for(ready_to_kill, procs[victim], logs[victim])
        # the survivor goes on alone for three steps, then waits until the victim is back (its start-up
        # is slow on a busy machine). The hold is set before the kill: set after watching the survivor
        # reach a step, a test process starved of CPU for two seconds let it run to the end first.
        held_at = _committed(out, survivor) + 3
        _hold(out, survivor, held_at)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        (out / f"hold-{victim}").unlink(missing_ok=True)  # its second life runs free
        _wait_for_step(out, survivor, held_at, procs[survivor], logs[survivor])
        time.sleep(1)
        procs[victim] = _start(victim, lighthouse, out, mode, logs[victim])
        _wait_for(lambda: any(out.glob(f"ready-{victim}-{procs[victim].life}")), procs[victim], logs[victim])
        (out / f"hold-{survivor}").unlink()
        _each_ends_well(procs, logs)
    # the restarted group healed from the survivor and went on from its step, not from 1
    second_life = [step for step, pid, _ in _records(out, victim) if pid == procs[victim].life]
    assert second_life and second_life[0] > held_at, f"group {victim} did not resume at its peer's step: {second_life}"
    assert second_life[-1] == _records(out, survivor)[-1][0]
    return held_at


def _each_ends_well(procs: list[subprocess.Popen[str]], logs: list[Path]) -> None:
    for group, proc in enumerate(procs):
        assert proc.wait(timeout=90) == 0, f"group {group} failed:\n{logs[group].read_text()[-4000:]}"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["split", "split fsdp", "split shuffle", "split stream"],
                         ids=["ddp_ft", "fsdp_ft-2-processes-per-group", "ddp_ft-shuffled", "ddp_ft-stream"])
def test_killed_group_heals_and_run_equals_one_plain_process(lighthouse: str, tmp_path: Path, mode: str,
                                                            plain_run: Callable[[Path], None]) -> None:
    _kill_and_restart(lighthouse, tmp_path, mode)
    # group 0 was never restarted: one process wrote every committed step, in order, up to the last
    records = _records(tmp_path, 0)
    assert [step for step, _, _ in records] == list(range(1, STEPS + 1))
    assert len({pid for _, pid, _ in records}) == 1
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)
    plain_run(tmp_path, shuffle="shuffle" in mode, stream="stream" in mode)  # one plain PyTorch loop over the same loader
    plain = _weights(tmp_path / "weights-plain.pt")
    assert sorted(plain) == sorted(first)
    for name in plain:
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=1e-5)
    # each group evaluated the whole set once, shared over its processes (none counted twice)
    plain_eval = _weights(tmp_path / "eval-plain.pt")
    for group in (0, 1):
        evaluated = _weights(tmp_path / f"eval-{group}.pt")
        assert evaluated[1].item() == plain_eval[1].item() == 10, f"group {group} counted {evaluated[1].item()} samples"
        torch.testing.assert_close(evaluated, plain_eval, rtol=1e-6, atol=0)  # float32 sums in another order
    # the monitor's rows (ft_train.py logs one per committed step, from the group that logs: group 0,
    # never killed) tell the dashboard what happened: the replica groups dip while group 1 is down
    [survivor] = _rows(tmp_path, 0)
    groups = [row["fault/replica_groups"] for row in survivor]
    assert [value for value, _ in itertools.groupby(groups)][-3:] == [2.0, 1.0, 2.0], groups
    assert _rows(tmp_path, 1) == [], "group 1 logged, but only the first group of the quorum logs"


# About 10 s when idle; 240 s is a hang guard only.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["split shuffle", "split stream"], ids=["ddp_ft-shuffled", "ddp_ft-stream"])
def test_a_group_that_never_comes_back_leaves_the_plain_run(lighthouse: str, tmp_path: Path, mode: str,
                                                             plain_run: Callable[[Path], None]) -> None:
    """Group 1 is SIGKILLed after its step 5 and not started again: group 0 goes on alone, taking
    each whole global batch, and ends where one plain process over the same loader ends."""
    logs = [tmp_path / "group-0.log", tmp_path / "group-1.log"]
    (tmp_path / "gate").touch()
    _hold(tmp_path, 1, 5)
    procs = [_start(g, lighthouse, tmp_path, mode, logs[g]) for g in (0, 1)]
    with killing_leftovers(procs):
        _open_the_gate_when_ready(tmp_path, procs, logs)
        _wait_for_step(tmp_path, 1, 5, procs[1], logs[1])
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        assert procs[0].wait(timeout=120) == 0, f"group 0 failed:\n{logs[0].read_text()[-4000:]}"
    records = _records(tmp_path, 0)
    assert [step for step, _, _ in records] == list(range(1, STEPS + 1)) and len({pid for _, pid, _ in records}) == 1
    assert not (tmp_path / "weights-1.pt").exists()
    plain_run(tmp_path, shuffle="shuffle" in mode, stream="stream" in mode)
    plain, alone = _weights(tmp_path / "weights-plain.pt"), _weights(tmp_path / "weights-0.pt")
    for name in plain:
        torch.testing.assert_close(alone[name], plain[name], rtol=0, atol=1e-5)


@pytest.mark.timeout(300)  # a hang guard: 15-26 s on an idle machine
@pytest.mark.parametrize("mode", ["split", "split fsdp"], ids=["ddp_ft", "fsdp_ft-2-processes-per-group"])
def test_a_group_started_again_resumes_from_the_latest_checkpoint_in_the_bucket(
        lighthouse: str, tmp_path: Path, s3_bucket: str, plain_run: Callable[[Path], None],
        caplog: pytest.LogCaptureFixture, mode: str) -> None:
    """The user's loop resumes at its top from `latest(bucket)` and saves to the bucket after each
    committed step: the group started again finds the survivor's checkpoint of the step it is held
    at, so it joins at the same step and needs no heal; the bucket alone brought it back. One group
    (the first of the quorum: group 0, or group 1 where group 0 missed a quorum) uploads each
    checkpoint, not every group (under `fsdp_ft`,
    whose groups write sharded checkpoints in place, two writers would delete each other's shards)."""
    caplog.set_level(logging.INFO, logger="werkzeug")  # the S3 server's requests (it runs in this process)
    held_at = _kill_and_restart(lighthouse, tmp_path, f"{mode} bucket={s3_bucket}/ft")
    if "fsdp" not in mode:
        # each one-file upload goes first to `.step-N.HOST-PID.XXXXXXXX.tmp`, named by its writer
        uploads = [re.search(r"PUT /[^/]+/ft/\.step-(\d+)\.\S+-(\d+)\.[0-9a-f]+\.tmp ", record.getMessage())
                   for record in caplog.records]
        writers = {int(found[1]): int(found[2]) for found in uploads if found}
        assert sorted(writers) == list(range(1, STEPS + 1)), writers
        # the first group of each step's quorum uploads: group 0, unless it missed a quorum (a loaded
        # machine: a fresh-clone CI run saw group 1 alone in one quorum, and upload that step)
        groups = {int(path.read_text()) for path in tmp_path.glob("pid-*")}  # each group's processes' pids
        assert set(writers.values()) <= groups, "a process of no group uploaded"
        assert len([found for found in uploads if found]) == STEPS, "a checkpoint was uploaded twice"
    victim_pid = max((p for p in tmp_path.glob("resumed-1-*")), key=lambda p: p.stat().st_mtime).name.split("-")[2]
    first_life = [step for step, pid, _ in _records(tmp_path, 1) if pid != int(victim_pid)]
    assert first_life[-1] < held_at  # the group was down while the survivor went on
    # its state came from the bucket, not from group 0: it loaded the survivor's checkpoint of the
    # step the survivor waits at, and so stood at that step before its first quorum. It then needs
    # no heal, unless a step of its second life fails (on a loaded machine, as one did in CI): the
    # survivor commits that step alone, and torchft rightly heals the group, which skips a step.
    assert (tmp_path / f"resumed-1-{victim_pid}").read_text() == f"step-{held_at} {held_at}"
    second_life = [step for step, pid, _ in _records(tmp_path, 1) if pid == int(victim_pid)]
    if second_life == list(range(held_at + 1, STEPS + 1)):  # no step of its second life failed
        assert (tmp_path / "heals-1").read_text() == "0"
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)
    plain_run(tmp_path)
    plain = _weights(tmp_path / "weights-plain.pt")
    for name in plain:
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=1e-5)


@pytest.mark.timeout(240)  # a hang guard: about 25 s on an idle machine
def test_a_killed_group_heals_under_fp8_with_float8_all_gather(lighthouse: str, tmp_path: Path) -> None:
    """FP8 (tensorwise, emulated) under `fsdp_ft`: FSDP2 all-gathers the weights in float8 (torchao's
    weight wrapper), and a group started again takes those weights and their optimizer state from its
    peer (torchft sends them as they are) and ends bitwise where the survivor ends."""
    pytest.importorskip("torchao", reason="needs lite-core[fp8] (torchao), which test-torchft installs")
    _kill_and_restart(lighthouse, tmp_path, "split fsdp fp8")
    gathered = {path.name: path.read_text() for path in tmp_path.glob("float8-all-gather-*")}
    assert set(gathered) == {f"float8-all-gather-{g}-{r}" for g in (0, 1) for r in (0, 1)}
    assert set(gathered.values()) == {"True"}, gathered
    assert int((tmp_path / "heals-1").read_text()) >= 1  # its state came from group 0
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert sorted(first) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight", "6.bias", "6.weight"]
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.timeout(240)  # a hang guard: about 15 s on an idle machine
def test_a_group_whose_run_ended_leaves_the_job_while_its_process_lives_on(lighthouse: str, tmp_path: Path) -> None:
    """Group 0 trains the whole run alone and its process lives on after `run()` (as a Ray worker
    waits for its peers); group 1 starts only then. The lighthouse forms no quorum without a
    majority of the groups it sees alive, so had group 0 gone on heartbeating, group 1 would have
    waited out its quorum timeout for a group that asks for no more quorums. It trains alone instead."""
    logs = [tmp_path / "group-0.log", tmp_path / "group-1.log"]
    (tmp_path / "linger").touch()
    procs = [_start(0, lighthouse, tmp_path, "split linger", logs[0])]
    with killing_leftovers(procs):
        _wait_for(lambda: (tmp_path / "finished-0").exists(), procs[0], logs[0])
        procs.append(_start(1, lighthouse, tmp_path, "split linger", logs[1]))
        _wait_for(lambda: (tmp_path / "finished-1").exists(), procs[1], logs[1])
        assert procs[0].poll() is None  # group 0's process lived on the whole time
        (tmp_path / "linger").unlink()
        _each_ends_well(procs, logs)
    for group in (0, 1):  # each trained every step alone, on whole batches
        assert [step for step, _, _ in _records(tmp_path, group)] == list(range(1, STEPS + 1))
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.timeout(150)
def test_without_split_batches_no_committed_step_repeats_or_skips_a_sample(lighthouse: str, tmp_path: Path) -> None:
    _kill_and_restart(lighthouse, tmp_path, "whole")
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)
    # every sample any process used in a committed step, the killed process's first life included
    used = [row for group in (0, 1) for _, _, rows in _records(tmp_path, group) for row in rows]
    counts = torch.bincount(torch.tensor(used), minlength=STEPS * 4)
    assert counts.max().item() == 1, f"a committed step repeated a sample: {counts.tolist()}"
    # the samples used are the loader's first ones: only a last remainder, fewer batches than the
    # step's processes, stays unused (as drop_last drops it), none in between
    unused = (counts == 0).nonzero().flatten().tolist()
    assert unused == list(range(STEPS * 4 - len(unused), STEPS * 4)) and len(unused) < 2 * 4, counts.tolist()


@pytest.mark.timeout(240)
def test_the_job_logs_one_tracker_run_whose_logging_moves_to_a_live_group(lighthouse: str, tmp_path: Path) -> None:
    pytest.importorskip("trackio", reason="needs lite-core[trackio] (installed in test-torchft)")
    # the group that logs dies after its step 5, once trackio's writer thread has stored some of its rows
    _kill_and_restart(lighthouse, tmp_path, "split trackio", victim=0,
                      ready_to_kill=lambda: _stored_rows(tmp_path / "trackio" / "ft.db") >= 3)
    runs, rows = _trackio_store(tmp_path / "trackio", "ft")
    assert len(runs) == 1, runs  # not a run per group, nor one for the takeover
    logs = [row for row in rows if "group" in row]  # the loop's own rows (the monitor's come apart)
    steps = [row["step"] for row in logs]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps  # no step logged twice
    by = [int(group) for group, _ in itertools.groupby(row["group"] for row in logs)]
    # group 0 logs, group 1 takes over while it is down, and group 0 (first in the quorum again once
    # it has healed) takes the logging back
    assert by == [0, 1, 0], [(row["step"], row["group"]) for row in logs]
    # what the dead group's tracker thread had not written before the kill is lost (at most the
    # half-second before it); every step from the takeover on is there
    takeover = next(row["step"] for row in logs if row["group"] == 1.0)
    assert steps[steps.index(takeover):] == list(range(takeover, STEPS + 1)), steps
    # the monitor's rows: one group while group 0 was down, and group 0's heal once it logs again
    monitor = [row for row in rows if "fault/heals" in row]
    back = next(row["step"] for row in logs if row["step"] > takeover and row["group"] == 0.0)
    assert {row["fault/replica_groups"] for row in monitor if takeover < row["step"] <= back - 2} == {1.0}, monitor
    assert all(row["fault/heals"] >= 1.0 for row in monitor if row["step"] > back), monitor


def _stored_rows(database: Path) -> int:
    """The metric rows trackio's SQLite store holds so far (0 before it exists)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
            return int(db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def _trackio_store(folder: Path, project: str) -> tuple[list[str], list[dict]]:
    """The runs of `project` in trackio's store at `folder`, and the first run's logged rows (read in
    a process of its own: trackio reads TRACKIO_DIR once, when it is imported)."""
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; runs = S.get_runs(sys.argv[1]);"
            " print(json.dumps([runs, S.get_logs(sys.argv[1], runs[0]) if runs else []], default=str))")
    done = subprocess.run([sys.executable, "-c", code, project], env=dict(os.environ, TRACKIO_DIR=str(folder)),
                          capture_output=True, text=True, timeout=120, check=True)
    runs, logs = json.loads(done.stdout.strip().splitlines()[-1])
    return runs, logs


def _rows(out: Path, group: int) -> list[list[dict[str, float]]]:
    """The monitor's rows of each life of the group that logged (a CSVLogger version each), in order."""
    folders = sorted((out / "rows" / f"group-{group}").glob("version_*"), key=lambda f: int(f.name.split("_")[1]))
    lives = [[{name: float(value) for name, value in row.items() if value} for row in csv.DictReader(f.open())]
             for f in (folder / "metrics.csv" for folder in folders) if f.exists()]
    return [monitor for life in lives if (monitor := [row for row in life if "fault/heals" in row])]


def _records(out: Path, group: int) -> list[tuple[int, int, list[int]]]:
    """(step, pid, sample indices) of each step the group committed."""
    lines = (out / f"progress-{group}").read_text().splitlines()
    return [(int(step), int(pid), [int(r) for r in rows]) for step, pid, *rows in (line.split() for line in lines)]
