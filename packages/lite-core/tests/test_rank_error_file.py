"""The error file a `lite run` rank leaves for torch's agent: whole, or not there at all.

The agent stops the other ranks as soon as one fails, then reads each rank's error file. A rank
stopped while torch's `record` was writing its file used to leave it empty, and the agent's own
read of it (`json.load`) ended `lite run` with a `JSONDecodeError` instead of its report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

pytestmark = pytest.mark.timeout(60)

_RAISES = "raise RuntimeError('boom in the script')\n"

# Runs a rank as `lite run` does, but the write of its error file is cut short by SIGTERM after
# its first bytes, as when the agent stops the rank at that moment.
_STOPPED_WHILE_WRITING = """
import json, os, signal, sys
from torch.distributed.elastic.multiprocessing.errors import error_handler
from lite_core.launchers import rank

def half_then_stopped(obj, fp, **kwargs):
    fp.write(json.dumps(obj)[:10])
    fp.flush()
    os.kill(os.getpid(), signal.SIGTERM)

error_handler.json.dump = half_then_stopped
rank.main(sys.argv[1:])
"""


def _run_rank(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(_RAISES)
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run([sys.executable, *command, str(script)], env=env, capture_output=True, text=True,
                          timeout=50)
    return proc, error_file


def test_a_rank_stopped_while_writing_its_error_file_leaves_no_file_for_the_agent_to_misread(tmp_path: Path) -> None:
    proc, error_file = _run_rank(tmp_path, "-c", _STOPPED_WHILE_WRITING)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert not error_file.exists(), f"a partial error file was left: {error_file.read_text()!r}"
    # What the agent makes of that rank's failure: no file, so it names the signal, and reads nothing.
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=proc.returncode, error_file=str(error_file))
    assert failure.message == "Signal 15 (SIGTERM) received by PID 1"


def test_a_rank_that_raises_leaves_a_whole_error_file_and_nothing_else(tmp_path: Path) -> None:
    proc, error_file = _run_rank(tmp_path, "-m", "lite_core.launchers.rank")
    assert proc.returncode == 1, proc.stderr
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "RuntimeError: boom in the script"
    assert "train.py" in failure.message["extraInfo"]["py_callstack"]
    assert json.loads(error_file.read_text()) == {"message": failure.message}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["error.json", "train.py"]


_REFUSED = ("from lite_core.errors import ConfigurationError\n"
            "raise ConfigurationError('devices=3 is not what lite run started: pass devices=2.')\n")


@pytest.mark.parametrize("error_file", [True, False])
def test_a_refused_configuration_ends_the_rank_with_its_sentence_and_no_traceback(tmp_path: Path,
                                                                                  error_file: bool) -> None:
    from lite_core.launchers.elastic import _refusal

    script = tmp_path / "train.py"
    script.write_text(_REFUSED)
    path = tmp_path / "error.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = str(path)
    proc = subprocess.run([sys.executable, "-m", "lite_core.launchers.rank", str(script)], env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    if not error_file:  # nobody reads an error file: the rank says it, in one line
        assert proc.stderr == "ConfigurationError: devices=3 is not what lite run started: pass devices=2.\n"
        return
    assert proc.stderr == ""  # the launcher says it once, for every rank
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert _refusal(failure) == "devices=3 is not what lite run started: pass devices=2."
    assert "train.py" in failure.message["extraInfo"]["py_callstack"]  # the traceback stays in the file
