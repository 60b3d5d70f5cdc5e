"""SIGTERM or Ctrl-C (SIGINT) sent to the launching process ends every rank, under every core
launcher (`lite run` is covered in tests/integration/test_cli.py).

The job is caught at its worst moment: rank 0 waits in an all_reduce that rank 1 never joins (the
collective timeout is 600 s here), so a rank that ignored the signal until its collective returned
would outlive the bound below by far: the bound is a hang guard, not a measure of speed. The signal
goes to the launching process only, not to its group.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]  # a hang guard above the bound below

#: Seconds from the signal to the end of every rank: about 1 s unloaded, 10 times that and more
#: under load, and far below the collective timeout a rank that ignored the signal would wait for.
MAX_SECONDS_AFTER_SIGNAL = 60.0
COLLECTIVE_TIMEOUT = "600"

# (launcher, signal, the launching process's expected exit code)
ROWS = [
    (launcher, sig, -sig)  # SIGTERM kills it outright; SIGINT's KeyboardInterrupt re-raises SIGINT at exit
    for launcher in ("ddp", "ddp_spawn", "ddp_fork")
    for sig in (signal.SIGTERM, signal.SIGINT)
]


@pytest.mark.parametrize(("launcher", "sig", "code"), ROWS, ids=[f"{r[0]}-{r[1].name}" for r in ROWS])
def test_signal_to_the_launching_process_ends_every_rank(launcher, sig, code, start_job, marker, survivors,
                                                         tmp_path):
    proc = start_job(launcher, "absent", 1, tmp_path, env={"LITE_COLLECTIVE_TIMEOUT": COLLECTIVE_TIMEOUT})
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready_rank*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is now blocked in its all_reduce

    sent = time.monotonic()
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=MAX_SECONDS_AFTER_SIGNAL)
    left = survivors(marker, max(0.0, MAX_SECONDS_AFTER_SIGNAL - (time.monotonic() - sent)))
    took = time.monotonic() - sent

    assert proc.returncode == code, f"{out}\n{err}"
    assert left == [], f"still running {took:.1f} s after {sig.name}: {left}\n{err}"
    assert took < MAX_SECONDS_AFTER_SIGNAL + 0.5
    assert not list(tmp_path.glob("survived_rank*"))
