"""Lite's guarantees under plain `torchrun` (torch's elastic agent without `lite run`): a rank
that is SIGKILLed ends the job within seconds with no process left behind, and a rank that never
arrives at a collective ends the job at the timeout with Lite's sentence naming the collective.
(torchrun itself exits with 1 rather than the rank's code: that is torchrun's own summary.)"""

from __future__ import annotations

import sys
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]  # a hang guard above the bounds below

#: Seconds between the kill and the end of the job: about 1 s unloaded, more under load, and far
#: below the collective timeout the survivor would wait out if the job were not ended for it. A hang
#: guard, not a measure of speed.
MAX_SECONDS_AFTER_KILL = 60.0


def torchrun(run_script, marker, port: int, *args, env=None):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={port}", "reliability_job.py", "ddp", *map(str, args)]
    return run_script(command=command, env={"LITE_TEST_JOB": marker, **(env or {})}, timeout=150)


def test_a_killed_rank_ends_the_torchrun_job(run_script, marker, survivors, free_tcp_port, tmp_path, output_of):
    proc = torchrun(run_script, marker, free_tcp_port(), "kill", 1, tmp_path, env={"LITE_COLLECTIVE_TIMEOUT": "600"})
    ended = time.time()
    assert proc.returncode != 0, output_of(proc)
    assert ended - float((tmp_path / "failed_at").read_text()) < MAX_SECONDS_AFTER_KILL
    assert "Signal 9 (SIGKILL) received by PID" in proc.stderr, output_of(proc)
    assert not list(tmp_path.glob("survived_rank*"))
    assert survivors(marker, 3.0) == [], output_of(proc)


def test_a_missing_rank_is_named_under_torchrun(run_script, marker, survivors, free_tcp_port, tmp_path, output_of,
                                                one_sentence):
    proc = torchrun(run_script, marker, free_tcp_port(), "absent", 1, tmp_path, "broadcast",
                    env={"LITE_COLLECTIVE_TIMEOUT": "2"})
    lines = [line for line in proc.stderr.splitlines() if "CollectiveTimeoutError: " in line]
    assert lines, output_of(proc)
    message = lines[-1].split("CollectiveTimeoutError: ", 1)[1]
    one_sentence(message)
    assert message.startswith("broadcast #2 timed out after 2 s on rank 0: rank 1 (last in barrier #1) did not arrive")
    assert proc.returncode != 0
    assert survivors(marker, 3.0) == [], output_of(proc)
