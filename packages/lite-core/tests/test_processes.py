"""Helpers the launchers share (how an exit is described, which rank is blamed for a failure), and
what a job run in this process leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_core.launchers.supervision import FAILURE_DIR_VARIABLE, describe_exit, rank_to_blame, record_failure


@pytest.mark.parametrize(("code", "text"), [(3, "exit code 3"), (-9, "signal 9 (SIGKILL)"), (-15, "signal 15 (SIGTERM)"),
                                            (-200, "signal 200")])
def test_describe_exit(code: int, text: str) -> None:
    assert describe_exit(code) == text


def test_the_rank_that_noted_its_failure_first_is_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILURE_DIR_VARIABLE, str(tmp_path))
    record_failure(1)  # raised first
    time.sleep(0.01)
    record_failure(0)  # failed a moment later, because rank 1 left its collective
    assert rank_to_blame(str(tmp_path), failed=[0]) == (1, 0)  # rank 1 has not ended yet: rank 0's exit is reported
    assert rank_to_blame(str(tmp_path), failed=[1]) == (1, 1)
    assert rank_to_blame(str(tmp_path), failed=[0, 1]) == (1, 1)


def test_a_rank_that_died_without_a_note_is_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILURE_DIR_VARIABLE, str(tmp_path))
    record_failure(0)  # rank 0's collective failed because rank 1 called os._exit
    assert rank_to_blame(str(tmp_path), failed=[1]) == (1, 1)
    assert rank_to_blame(str(tmp_path), failed=[0, 1]) == (1, 1)


def _note(folder: Path, when: dict[int, float]) -> None:
    """Failure notes as `record_failure` writes them, at the given times."""
    for rank, seconds in when.items():
        (folder / f"rank{rank}").write_text(repr(seconds))


@pytest.mark.parametrize(("noted", "failed", "blamed"), [
    ({0: 1.0, 2: 2.0}, [0, 1, 2, 3], (1, 1)),  # the lowest rank that died without a note, however early the notes
    ({0: 3.0, 1: 1.0, 2: 2.0}, [2, 0, 1], (1, 1)),  # every failed rank noted: the earliest note
    ({0: 3.0, 1: 1.0, 2: 2.0}, [0, 2], (1, 2)),  # rank 1 noted first but has not ended: the earliest of the failed
    ({1: 1.0}, [3, 2], (2, 2)),  # a note of a rank that did not fail does not hide an abrupt death
])
def test_the_rank_to_blame_among_several_failed(tmp_path: Path, noted: dict[int, float], failed: list[int],
                                                 blamed: tuple[int, int]) -> None:
    _note(tmp_path, noted)
    assert rank_to_blame(str(tmp_path), failed) == blamed


def test_without_the_variable_nothing_is_noted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAILURE_DIR_VARIABLE, raising=False)
    record_failure(0)
    assert rank_to_blame(str(tmp_path), failed=[0]) == (0, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_rank_killed_by_someone_else_while_the_ranks_are_stopped_is_still_a_failure() -> None:
    # The ddp launcher stops the other ranks when its own rank fails, which is often because a
    # peer was just killed: that peer's death must still be reported (its waiter thread holds
    # the process, so `poll()` said "running" and the kill was taken for the launcher's own).
    from lite_core.launchers.supervision import RankProcesses

    ranks = RankProcesses()
    ranks.start(1, [sys.executable, "-c", "import time; time.sleep(60)"], env={})
    ranks.start(2, [sys.executable, "-c", "import time; time.sleep(60)"], env={})
    time.sleep(0.5)
    ranks._processes[1].send_signal(signal.SIGKILL)  # someone else kills rank 1
    ranks.stop()  # then the launcher stops every rank
    assert ranks.watch() == (1, -signal.SIGKILL)


class _OneProcessJob(LightningLite):
    def run(self) -> int:
        return int(self.all_reduce(torch.tensor(1), reduce_op="sum").item())


_NOTEBOOK = """
import os, subprocess, sys
import torch
from lite_core import LightningLite

class Job(LightningLite):
    def run(self):
        return int(self.all_reduce(torch.tensor(1), reduce_op="sum").item())

assert Job(accelerator="cpu", strategy=sys.argv[1], devices=1).run() == 1
print(sorted(name for name in ("MASTER_ADDR", "MASTER_PORT") if name in os.environ))
later = "from lite_core import LightningLite; lite = LightningLite(accelerator='cpu', devices=1, strategy='ddp'); lite.launch(); lite.barrier()"
sys.exit(subprocess.run([sys.executable, "-c", later]).returncode)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_job_started_after_an_in_process_job_does_not_inherit_its_port(strategy: str) -> None:
    # A one-process job runs in the process (a notebook's kernel), which keeps listening on the
    # job's port while its process group lives. A `python train.py` started from there later (a
    # notebook's `!python`) inherited MASTER_PORT and failed: "MASTER_PORT=... is already in use".
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-c", _NOTEBOOK, strategy], env=env, capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"  # the kernel's environment is as it was


@pytest.mark.timeout(60)
def test_a_port_the_user_chose_stays_chosen_after_an_in_process_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from lite_core.environments.local import find_free_port

    port = str(find_free_port())
    monkeypatch.setenv("MASTER_PORT", port)
    assert _OneProcessJob(accelerator="cpu", strategy="ddp", devices=1).run() == 1
    assert os.environ["MASTER_PORT"] == port


# -- the machine's cores ---------------------------------------------------------------------------
def _cores(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)))


def _children() -> list[str]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as handle:
        return handle.read().split()


def test_devices_far_above_the_cores_are_refused_at_construction(clean_env: None) -> None:
    before = _children()
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigurationError, match=rf"^devices=1000 would start 1000 processes on this machine, which"
                                                 rf" has {cores} usable CPU core\(s\): pass devices="):
        LightningLite(accelerator="cpu", strategy="ddp", devices=1000)
    assert _children() == before  # no process started


@pytest.mark.parametrize(("cores", "allowed"), [(1, 8), (2, 8), (3, 12), (16, 64)])
def test_the_bound_is_four_processes_per_core_and_at_least_eight(monkeypatch: pytest.MonkeyPatch, clean_env: None,
                                                                 cores: int, allowed: int) -> None:
    _cores(monkeypatch, cores)
    for strategy in ("ddp", "ddp_spawn", "ddp_fork"):
        LightningLite(accelerator="cpu", strategy=strategy, devices=allowed)
        with pytest.raises(ConfigurationError, match=rf"pass devices={allowed} or fewer \(at most 4 processes per"
                                                     r" core\), or run on a machine with more cores\.$"):
            LightningLite(accelerator="cpu", strategy=strategy, devices=allowed + 1)


def test_ranks_a_scheduler_started_are_not_counted_against_the_cores(monkeypatch: pytest.MonkeyPatch,
                                                                     clean_env: None) -> None:
    # They are running already, and a scheduler may have bound each to a core of its own.
    _cores(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    monkeypatch.setenv("WORLD_SIZE", "16")
    LightningLite(accelerator="cpu", strategy="ddp", devices=16)


def test_more_processes_than_cores_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from lite_core.launchers._cores import warn_if_oversubscribed

    _cores(monkeypatch, 2)
    warn_if_oversubscribed(2)  # one process per core: nothing to say
    with pytest.warns(UserWarning, match=r"^3 processes share this machine's 2 usable CPU core\(s\), so each computes"
                                         r" slower than on a core of its own: start at most 2 \(devices=2\)") as seen:
        warn_if_oversubscribed(3)
    assert seen[0].filename == __file__  # the user's line


def test_the_threads_of_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from lite_core.launchers._cores import rank_threads, threads_notice

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (rank_threads(1), rank_threads(2)) == (None, 1)  # one rank keeps torch's default
    _cores(monkeypatch, 16)
    assert threads_notice(2, 1) == ("each of the 2 ranks on this machine computes on 1 CPU thread (OMP_NUM_THREADS=1,"
                                    " as torchrun sets it), and 16 cores are usable: export OMP_NUM_THREADS=8 to use"
                                    " them all.")
    _cores(monkeypatch, 2)
    assert threads_notice(2, 1) is None  # every core busy: nothing to tune
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert rank_threads(2) is None  # the user's choice
