"""`lite run --replica-groups 2`: a lighthouse and two groups on this machine, a failed group started again.

The worker of group 1 is SIGKILLed mid-run: its `lite run` fails, the launcher starts the group
again, and it heals from group 0, which goes on. Both end with the same weights as one plain process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import script_env  # the repository's conftest.py

SCRIPT = Path(__file__).parent / "scripts" / "ft_train.py"



def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _wait(condition, launcher: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 90
    while not condition():
        assert launcher.poll() is None, f"lite run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in 90 s"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_lite_run_starts_the_groups_and_starts_a_failed_group_again(tmp_path: Path,
                                                                   plain_run: Callable[[Path], None]) -> None:
    env = script_env(FT_STEP_SLEEP="0.1", LITE_COLLECTIVE_TIMEOUT="10")
    command = [sys.executable, "-m", "lite_core.cli", "run", "--replica-groups", "2", str(SCRIPT), str(tmp_path), "split"]
    launcher = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: len(_lines(tmp_path / "progress-1")) >= 3, launcher, "step 3 of group 1")
        worker = int(_lines(tmp_path / "progress-1")[-1][1])
        (tmp_path / "hold-0").touch()  # group 0 waits between steps until group 1 is back
        os.kill(worker, signal.SIGKILL)
        _wait(lambda: any(int(pid) != worker for _, pid in (p.name.split("-")[1:] for p in tmp_path.glob("ready-1-*"))),
              launcher, "restart of group 1")
        (tmp_path / "hold-0").unlink()
        output, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-4000:]
    assert "replica group 1 exited with" in output and "starting it again (1/3)" in output, output[-4000:]
    assert len({pid for _, pid, *_ in _lines(tmp_path / "progress-0")}) == 1  # group 0 was never restarted
    first = torch.load(tmp_path / "weights-0.pt", weights_only=True)
    second = torch.load(tmp_path / "weights-1.pt", weights_only=True)
    plain_run(tmp_path)  # in this process: one plain PyTorch loop over the same loader
    plain = torch.load(tmp_path / "weights-plain.pt", weights_only=True)
    for name in plain:
        assert torch.equal(first[name], second[name])
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=1e-5)


def test_replica_groups_without_a_number_is_refused() -> None:
    from lite_core.cli._groups import without_flag
    from lite_core.plugins import ConfigurationError

    assert without_flag(["--replica-groups", "2", "--devices", "1", "train.py", "--replica-groups", "x"]) == (
        2, ["--devices", "1", "train.py", "--replica-groups", "x"])
    with pytest.raises(ConfigurationError, match="--replica-groups zero is not a positive number"):
        without_flag(["--replica-groups=zero", "train.py"])


@pytest.mark.timeout(120)
def test_a_group_that_keeps_failing_is_given_up_after_its_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    from lite_torchft.launch import run_replica_groups

    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nopen(sys.argv[1], 'a').write('tried\\n')\nsys.exit(3)\n")
    for name, value in script_env(LITE_GROUP_RESTARTS="1").items():
        monkeypatch.setenv(name, value)
    tries = tmp_path / "tries"
    assert run_replica_groups(1, [str(failing), str(tries)], "lite run") == 1
    assert tries.read_text().count("tried") == 2  # the first start and one restart
    assert "replica group 0 failed 2 times (last exit code 3): given up" in capfd.readouterr().err


@pytest.mark.timeout(120)
def test_each_group_meets_on_a_port_the_kernel_does_not_hand_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A port found with bind(0) lies in the ephemeral range, where any outgoing connection may take
    # it before the group's store binds it.
    from lite_torchft.launch import run_replica_groups

    script = tmp_path / "port.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'a').write(os.environ['MASTER_PORT'] + '\\n')\n")
    for name, value in script_env().items():
        monkeypatch.setenv(name, value)
    ports = tmp_path / "ports"
    assert run_replica_groups(2, [str(script), str(ports)], "lite run") == 0
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chosen = [int(port) for port in ports.read_text().split()]
    assert len(set(chosen)) == 2 and max(chosen) < first_ephemeral, chosen
