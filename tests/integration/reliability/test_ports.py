"""A MASTER_PORT that another process already holds: rank 0 says so in one sentence, naming the
port and the fix, and the job ends (instead of a raw torch traceback or a hang). Two jobs started
without a port never collide: see tests/integration/test_ddp_launching.py."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds for the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def _via_environment(port: int, out: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "reliability_job.py", "ddp", "absent", "9", out], {"MASTER_PORT": str(port)}


def _via_spawn(port: int, out: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "reliability_job.py", "ddp_spawn", "absent", "9", out], {"MASTER_PORT": str(port)}


def _via_lite_run(port: int, out: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "2", "--main-port",
            str(port), "reliability_job.py", "ddp", "absent", "9", out], {}


@pytest.mark.parametrize("how", [_via_environment, _via_spawn, _via_lite_run], ids=["ddp", "ddp_spawn", "lite-run"])
def test_port_in_use_is_one_sentence_naming_it(how, taken_port, run_script, marker, survivors, tmp_path, output_of,
                                               one_sentence):
    command, env = how(taken_port, str(tmp_path))
    proc = run_script(command=command, env={"LITE_TEST_JOB": marker, **env}, timeout=60)
    assert proc.returncode != 0, output_of(proc)
    # Rank 0 raises it under Lite's own launchers; under `lite run` the agent hosts the port and
    # `lite run` says it (`lite run: error: ...`).
    prefix = "lite run: error: " if how is _via_lite_run else "ConfigurationError: "
    lines = [line for line in proc.stderr.splitlines() if prefix in line]
    assert lines, output_of(proc)
    message = lines[-1].split(prefix, 1)[1]
    one_sentence(message)
    assert message.startswith(f"MASTER_PORT={taken_port} is already in use on 127.0.0.1")
    assert "pick another free port, or unset MASTER_PORT" in message
    assert not list(tmp_path.glob("ready_rank*"))  # no rank got past the rendezvous
    assert survivors(marker, 3.0) == [], output_of(proc)
