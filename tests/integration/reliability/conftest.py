"""Helpers for the reliability suite: run `reliability_job.py` under every core launcher, find
processes a job left behind, and check that an error message is one sentence.

Every job gets a unique `LITE_TEST_JOB` marker in its environment, which every process it starts
inherits; `survivors(marker)` scans the process table (`/proc/*/environ`) for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

#: The launchers of lite-core, as `reliability_job.py` and `lite run` start them.
LAUNCHERS = ("ddp", "ddp-launch", "ddp_spawn", "ddp_fork", "lite-run")
MARKER_VARIABLE = "LITE_TEST_JOB"


def job_command(launcher: str, *args: Any) -> list[str]:
    """The command line that runs `reliability_job.py` under `launcher`."""
    if launcher == "lite-run":
        return [sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "2",
                "reliability_job.py", "ddp", *map(str, args)]
    return [sys.executable, "reliability_job.py", launcher, *map(str, args)]


def _environ_has(pid: str, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return marker in handle.read()
    except OSError:  # gone, or not ours to read
        return False


def _is_running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def find_survivors(marker: str, seconds: float) -> list[str]:
    """Processes (pid and command line) whose environment holds `marker`, after waiting up to
    `seconds` for them to go."""
    needle = f"{MARKER_VARIABLE}={marker}\0".encode()
    deadline = time.monotonic() + seconds
    while True:
        found = [pid for pid in os.listdir("/proc")
                 if pid.isdigit() and int(pid) != os.getpid() and _environ_has(pid, needle) and _is_running(pid)]
        if not found or time.monotonic() > deadline:
            return [f"{pid}: {_cmdline(pid)}" for pid in found]
        time.sleep(0.1)


@pytest.fixture
def marker() -> Any:
    """A unique marker for one job's environment; its processes are SIGKILLed at the end of the test."""
    value = uuid.uuid4().hex
    yield value
    for line in find_survivors(value, 0):
        try:
            os.kill(int(line.split(":", 1)[0]), 9)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def survivors() -> Callable[[str, float], list[str]]:
    """`survivors(marker, seconds)` -> processes of the job still running after `seconds`."""
    return find_survivors


@pytest.fixture
def run_job(run_script: Any, marker: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_job(launcher, *args, env=..., timeout=...)`: run `reliability_job.py` to completion,
    marked with this test's `marker`."""

    def run(launcher: str, *args: Any, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {MARKER_VARIABLE: marker, **(env or {})}
        return run_script(command=job_command(launcher, *args), env=env, timeout=timeout)

    return run


@pytest.fixture
def start_job(scripts_env: Any, marker: str, signals_as_in_a_terminal: Callable[[], None]
              ) -> Callable[..., subprocess.Popen[str]]:
    """`start_job(launcher, *args, env=...)` -> Popen of `reliability_job.py` in its own session, marked with
    this test's `marker` (whatever it leaves running is killed after the test)."""
    scripts = Path(__file__).resolve().parents[2] / "scripts"

    def start(launcher: str, *args: Any, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        # Fresh interpreters, not forked from the test session's server (tools/forkserver): SIGTERM to
        # a `ddp` or `ddp_spawn` launcher whose rank 1 was forked left the job running past the
        # bound in 3 of 4 loaded full runs (never alone); not understood yet.
        env = scripts_env(**{MARKER_VARIABLE: marker, "LITE_TEST_FORKSERVER": "0", **(env or {})})
        return subprocess.Popen(job_command(launcher, *args), cwd=scripts, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=signals_as_in_a_terminal)

    return start


def check_one_sentence(message: str) -> None:
    """Assert that `message` is one sentence: one line that ends with a period, and no sentence
    end inside it (a `.`, `!` or `?` followed by a capitalised word; "e.g. x" is fine)."""
    assert message, "the error has no message"
    assert "\n" not in message, f"not a single line: {message!r}"
    assert message.endswith("."), f"does not end with a period: {message!r}"
    assert not re.search(r"[.!?]\s+[A-Z][a-z]", message[:-1]), f"more than one sentence: {message!r}"


@pytest.fixture(scope="session")
def one_sentence() -> Callable[[str], None]:
    """`one_sentence(message)`: assert the message is one single-line sentence."""
    return check_one_sentence
