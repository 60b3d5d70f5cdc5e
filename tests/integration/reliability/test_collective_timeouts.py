"""A rank that never arrives at a collective: the others fail after the configured timeout with one
sentence naming the collective and the missing rank, and the whole job ends.

Each row runs `reliability_job.py ... absent RANK`: rank RANK sleeps for ten minutes after the
first barrier, while the other rank enters COLLECTIVE (its Lite collective #2) with
`LITE_COLLECTIVE_TIMEOUT=2`.
"""

from __future__ import annotations

import re
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]  # a hang guard above the bound below

TIMEOUT_SECONDS = 2
#: Seconds the job may take to end after the timeout fired (diagnosis, then every launcher's
#: teardown): a few unloaded, and far below the ten minutes the absent rank sleeps, which a job
#: that waited for it would take. A hang guard, not a measure of speed (12 s were seen under load).
MAX_SECONDS_AFTER_TIMEOUT = 60.0

# (launcher, collective, the rank that never arrives)
ROWS = [
    ("ddp_fork", "barrier", 1),
    ("ddp_fork", "all_reduce", 1),
    ("ddp_fork", "all_gather", 1),
    ("ddp_fork", "broadcast", 1),
    ("ddp", "all_reduce", 0),  # the absent rank is the launching process
    ("ddp_spawn", "barrier", 1),
    ("lite-run", "all_gather", 0),
]


@pytest.mark.parametrize(("launcher", "collective", "absent"), ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_missing_rank_is_named_after_the_timeout(launcher, collective, absent, run_job, marker, survivors,
                                                 tmp_path, output_of, one_sentence):
    proc = run_job(launcher, "absent", absent, tmp_path, collective, env={"LITE_COLLECTIVE_TIMEOUT": str(TIMEOUT_SECONDS)},
                   timeout=2 * MAX_SECONDS_AFTER_TIMEOUT)
    ended = time.time()

    waiting = 1 - absent
    lines = [line for line in proc.stderr.splitlines() if "CollectiveTimeoutError: " in line]
    assert lines, output_of(proc)
    message = lines[-1].split("CollectiveTimeoutError: ", 1)[1]
    one_sentence(message)
    assert message == (
        f"{collective} #2 timed out after {TIMEOUT_SECONDS} s on rank {waiting}: rank {absent} (last in barrier #1)"
        " did not arrive; make every rank call the same collectives in the same order, or raise"
        " LITE_COLLECTIVE_TIMEOUT (or the strategy's timeout)."
    )
    assert proc.returncode != 0, output_of(proc)
    # It waited for the timeout, then the whole job (the absent rank included) ended promptly.
    entered = (tmp_path / f"ready_rank{waiting}").stat().st_mtime
    assert ended - entered >= TIMEOUT_SECONDS
    assert ended - entered < TIMEOUT_SECONDS + MAX_SECONDS_AFTER_TIMEOUT, f"ended {ended - entered:.1f} s after"
    assert not list(tmp_path.glob("survived_rank*")), output_of(proc)
    assert survivors(marker, 3.0) == [], output_of(proc)
    assert not re.search(r"Timed out waiting \d+ms", proc.stderr.split("CollectiveTimeoutError", 1)[1])
