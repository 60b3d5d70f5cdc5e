"""Helpers the launchers share: how an exit is described and which rank is blamed for a failure."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from lite_core.launchers.supervision import FAILURE_DIR_VARIABLE, describe_exit, rank_to_blame, record_failure


@pytest.mark.parametrize(("code", "text"), [(3, "exit code 3"), (-9, "signal 9 (SIGKILL)"), (-15, "signal 15 (SIGTERM)"),
                                            (-200, "signal 200")])
def test_describe_exit(code: int, text: str) -> None:
    assert describe_exit(code) == text


def test_the_rank_that_noted_its_failure_first_is_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILURE_DIR_VARIABLE, str(tmp_path))
    record_failure(1)  # raised first
    record_failure(0)  # failed a moment later, because rank 1 left its collective
    assert rank_to_blame(str(tmp_path), exited=0) == 1
    assert rank_to_blame(str(tmp_path), exited=1) == 1


def test_a_rank_that_died_without_a_note_is_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILURE_DIR_VARIABLE, str(tmp_path))
    record_failure(0)  # rank 0's collective failed because rank 1 called os._exit
    assert rank_to_blame(str(tmp_path), exited=1) == 1


def test_without_the_variable_nothing_is_noted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAILURE_DIR_VARIABLE, raising=False)
    record_failure(0)
    assert rank_to_blame(str(tmp_path), exited=0) == 0
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
