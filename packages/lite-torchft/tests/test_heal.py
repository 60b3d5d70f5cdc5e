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

import csv
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import free_port, script_env  # the repository's conftest.py

SCRIPT = Path(__file__).parent / "scripts" / "ft_train.py"

STEPS = 24  # ft_train.STEPS


def _start(group: int, lighthouse: str, out: Path, mode: str, log: Path) -> subprocess.Popen[str]:
    env = script_env(LITE_COLLECTIVE_TIMEOUT="10", REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FT_STEP_SLEEP="0.1")
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), *mode.split()], env=env, text=True,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def _committed(out: Path, group: int) -> int:
    progress = out / f"progress-{group}"
    return len(progress.read_text().splitlines()) if progress.exists() else 0


def _wait_for_step(out: Path, group: int, step: int, proc: subprocess.Popen[str], log: Path) -> None:
    _wait_for(lambda: _committed(out, group) >= step, proc, log)


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert proc.poll() is None, f"the group ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the group made no progress:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _hold(out: Path, group: int, at_step: int) -> None:
    """Group `group` waits between steps once it has committed `at_step`, until `hold-<group>` is removed."""
    part = out / f"hold-{group}.part"
    part.write_text(str(at_step))
    part.replace(out / f"hold-{group}")  # the group never reads a half-written file


def _kill_and_restart(lighthouse: str, out: Path, mode: str) -> None:
    logs = [out / "group-0.log", out / "group-1.log"]
    group0, group1 = (_start(g, lighthouse, out, mode, logs[g]) for g in (0, 1))
    try:
        _wait_for_step(out, 1, 5, group1, logs[1])
        # group 0 goes on alone for three steps, then waits until group 1 is back (its start-up is slow
        # on a busy machine). The hold is set before the kill: set after watching group 0 reach a step,
        # a test process starved of CPU for two seconds let group 0 run to the end first.
        held_at = _committed(out, 0) + 3
        _hold(out, 0, held_at)
        os.kill(group1.pid, signal.SIGKILL)
        group1.wait()
        _wait_for_step(out, 0, held_at, group0, logs[0])
        time.sleep(1)
        group1 = _start(1, lighthouse, out, mode, logs[1])
        _wait_for(lambda: any(out.glob(f"ready-1-{group1.pid}")), group1, logs[1])
        (out / "hold-0").unlink()
        for group, proc in ((0, group0), (1, group1)):
            assert proc.wait(timeout=90) == 0, f"group {group} failed:\n{logs[group].read_text()[-4000:]}"
    finally:
        for proc in (group0, group1):
            if proc.poll() is None:
                proc.kill()
    # the restarted group healed from group 0 and went on from group 0's step, not from 1
    second_life = [step for step, pid, _ in _records(out, 1) if pid == group1.pid]
    assert second_life and second_life[0] > held_at, f"group 1 did not resume at its peer's step: {second_life}"
    assert second_life[-1] == _records(out, 0)[-1][0]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["split", "split fsdp"], ids=["ddp_ft", "fsdp_ft-2-processes-per-group"])
def test_killed_group_heals_and_run_equals_one_plain_process(lighthouse: str, tmp_path: Path, mode: str,
                                                            plain_run: Callable[[Path], None]) -> None:
    _kill_and_restart(lighthouse, tmp_path, mode)
    # group 0 was never restarted: one process wrote every committed step, in order, up to the last
    records = _records(tmp_path, 0)
    assert [step for step, _, _ in records] == list(range(1, STEPS + 1))
    assert len({pid for _, pid, _ in records}) == 1
    first, second = _weights(tmp_path / "weights-0.pt"), _weights(tmp_path / "weights-1.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)
    plain_run(tmp_path)  # in this process: one plain PyTorch loop over the same loader
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
    # the monitor's rows (ft_train.py logs one per committed step) tell the dashboard what happened
    survivor = _rows(tmp_path, 0)[-1]
    groups = [row["fault/replica_groups"] for row in survivor]
    assert [value for value, _ in itertools.groupby(groups)][-3:] == [2.0, 1.0, 2.0], groups
    restarted = _rows(tmp_path, 1)[-1]  # the second life's rows
    assert restarted and all(row["fault/heals"] >= 1.0 for row in restarted), restarted


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


def _rows(out: Path, group: int) -> list[list[dict[str, float]]]:
    """The monitor's rows of each life of the group (a CSVLogger version each), in order."""
    folders = sorted((out / "rows" / f"group-{group}").glob("version_*"), key=lambda f: int(f.name.split("_")[1]))
    return [[{name: float(value) for name, value in row.items() if value} for row in csv.DictReader(f.open())]
            for f in (folder / "metrics.csv" for folder in folders) if f.exists()]


def _records(out: Path, group: int) -> list[tuple[int, int, list[int]]]:
    """(step, pid, sample indices) of each step the group committed."""
    lines = (out / f"progress-{group}").read_text().splitlines()
    return [(int(step), int(pid), [int(r) for r in rows]) for step, pid, *rows in (line.split() for line in lines)]
