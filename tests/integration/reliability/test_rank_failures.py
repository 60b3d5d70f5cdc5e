"""A failing rank ends the whole job under every core launcher, quickly, loudly and completely.

Each row runs `reliability_job.py`: one rank fails (raises, calls `os._exit(3)` or SIGKILLs
itself) 0.5 s after both ranks are up, while the other waits in an all_reduce that can never
complete (the collective timeout is 600 s here). The job must end long before that, with a
non-zero exit code, show the failing rank's message, and leave no process behind.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]  # a hang guard above the bound below

#: Seconds between the failure and the end of the whole job: about 1 s unloaded, 10 times that and
#: more under load, and far below the collective timeout a job that waited for it would take. A hang
#: guard, not a measure of speed.
MAX_SECONDS_AFTER_FAILURE = 60.0
COLLECTIVE_TIMEOUT = "600"

_SIGKILLED = 128 + signal.SIGKILL  # how Lite's launchers report a rank killed by SIGKILL
# (launcher, action, failing rank, expected exit code, regex the output must contain)
ROWS = [
    ("ddp", "raise", 1, 1, r"RuntimeError: boom on rank 1"),
    ("ddp", "exit", 1, 3, r"lite: local rank 1 failed with exit code 3; stopping every rank\."),
    ("ddp", "kill", 1, _SIGKILLED, r"lite: local rank 1 failed with signal 9 \(SIGKILL\); stopping every rank\."),
    ("ddp", "raise", 0, 1, r"RuntimeError: boom on rank 0"),
    # Rank 0 is the launching process itself: its own exit status is the report.
    ("ddp", "exit", 0, 3, None),
    ("ddp", "kill", 0, -signal.SIGKILL, None),
    ("ddp-launch", "raise", 0, 1, r"RuntimeError: boom on rank 0"),
    ("ddp_spawn", "raise", 1, 1, r"RuntimeError: boom on rank 1"),
    ("ddp_spawn", "exit", 1, 1, r"process 1 terminated with exit code 3"),
    ("ddp_spawn", "kill", 1, 1, r"process 1 terminated with signal SIGKILL"),
    ("ddp_fork", "raise", 1, 1, r"RuntimeError: boom on rank 1"),
    ("ddp_fork", "exit", 1, 1, r"process 1 terminated with exit code 3"),
    ("ddp_fork", "kill", 1, 1, r"process 1 terminated with signal SIGKILL"),
    # Rank 0 fails too (its all_reduce loses its peer) and may exit first: rank 1 is still blamed.
    ("lite-run", "raise", 1, 1, r"lite run: local rank 1 failed (with exit code 1|first \(its error is above\) and"
                                r" local rank 0 then ended with exit code 1); stopping every rank\."),
    ("lite-run", "exit", 1, 3, r"lite run: local rank 1 failed with exit code 3; stopping every rank\."),
    ("lite-run", "kill", 1, _SIGKILLED, r"lite run: local rank 1 failed with signal 9 \(SIGKILL\); stopping every rank\."),
]


@pytest.mark.parametrize(("launcher", "action", "rank", "code", "message"), ROWS,
                         ids=[f"{row[0]}-{row[1]}-rank{row[2]}" for row in ROWS])
def test_failing_rank_ends_the_job(launcher, action, rank, code, message, run_job, marker, survivors, tmp_path,
                                   output_of):
    proc = run_job(launcher, action, rank, tmp_path, env={"LITE_COLLECTIVE_TIMEOUT": COLLECTIVE_TIMEOUT},
                   timeout=2 * MAX_SECONDS_AFTER_FAILURE)
    ended = time.time()

    failed_at = float((tmp_path / "failed_at").read_text())
    assert ended - failed_at < MAX_SECONDS_AFTER_FAILURE, f"ended {ended - failed_at:.1f} s after the failure"
    assert proc.returncode == code, output_of(proc)
    if message is not None:
        assert re.search(message, proc.stderr), output_of(proc)
    if action == "raise":
        assert f"RuntimeError: boom on rank {rank}" in proc.stderr, output_of(proc)
    assert "UNEXPECTED" not in proc.stdout, output_of(proc)
    other = 1 - rank  # stopped because of the failure: never reported as the one that failed
    assert f"local rank {other} failed" not in proc.stderr and f"process {other} terminated" not in proc.stderr
    assert not list(tmp_path.glob("survived_rank*")), "the surviving rank's collective returned"
    assert survivors(marker, 3.0) == [], output_of(proc)
    # Both ranks were really up: the failure happened in a running 2-process job.
    assert sorted(p.name for p in Path(tmp_path).glob("ready_rank*")) == ["ready_rank0", "ready_rank1"]
