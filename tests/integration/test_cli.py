"""The `lite` command line: `lite run` against torchrun, failures and signals, and `lite env`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

LITE = [sys.executable, "-m", "lite_core.cli"]


def records(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


def lite_run(run_script, out_dir: Path, *options: str, script: tuple[str, ...] = ("cli_job.py",),
             mode: str = "default", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*LITE, "run", *options, *script, str(out_dir), mode]
    return run_script(command=command, env=env)


def assert_same_job(a: list[dict], b: list[dict]) -> None:
    assert [r["global_rank"] for r in a] == [r["global_rank"] for r in b] == [0, 1]
    assert [r["local_rank"] for r in a] == [r["local_rank"] for r in b] == [0, 1]
    for x, y in zip(a, b):
        assert x["world_size"] == y["world_size"] == 2
        assert (x["strategy"], x["accelerator"], x["precision"]) == (y["strategy"], y["accelerator"], y["precision"])
        assert x["losses"] == y["losses"]
        assert x["weight"] == y["weight"]


# -- lite run ----------------------------------------------------------------------------------------
def test_lite_run_equals_torchrun_of_the_same_script(run_script, free_tcp_port, tmp_path, output_of):
    by_lite, by_torchrun = tmp_path / "lite", tmp_path / "torchrun"
    by_lite.mkdir(), by_torchrun.mkdir()
    launcher = Path(sys.executable).with_name("lite")  # the installed console script
    proc = run_script(command=[str(launcher), "run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", "2",
                               "cli_job.py", str(by_lite)])
    assert proc.returncode == 0, output_of(proc)
    # torchrun starts the processes; the script's choices come from the same variables lite run sets.
    proc = run_script("cli_job.py", by_torchrun, python_args=(
        "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_tcp_port()}"), env={"LITE_ACCELERATOR": "cpu", "LITE_STRATEGY": "ddp",
                                                   "LITE_DEVICES": "2"})
    assert proc.returncode == 0, output_of(proc)

    lite, torchrun = records(by_lite), records(by_torchrun)
    assert_same_job(lite, torchrun)
    assert lite[0]["strategy"] == "ddp" and lite[0]["losses"][-1] < lite[0]["losses"][0]
    # lite run itself started both ranks (Lite's own launcher started nothing), like torchrun.
    assert lite[0]["ppid"] == lite[1]["ppid"] not in (lite[0]["pid"], lite[1]["pid"])
    assert lite[1]["env"]["LOCAL_WORLD_SIZE"] == "2" and lite[1]["env"]["RANK"] == "1"


def test_lite_run_module_and_plain_python_give_the_same_job(run_script, tmp_path, output_of):
    by_module, by_python = tmp_path / "module", tmp_path / "python"
    by_module.mkdir(), by_python.mkdir()
    # LITE_DEVICES exported around lite run counts like --devices 2.
    proc = lite_run(run_script, by_module, "--accelerator", "cpu", script=("-m", "cli_job"), env={"LITE_DEVICES": "2"})
    assert proc.returncode == 0, output_of(proc)
    # The unmodified script under plain `python`: Lite's own ddp launcher re-runs it.
    proc = run_script("cli_job.py", by_python, "default",
                      env={"LITE_ACCELERATOR": "cpu", "LITE_STRATEGY": "ddp", "LITE_DEVICES": "2"})
    assert proc.returncode == 0, output_of(proc)

    module, python = records(by_module), records(by_python)
    assert_same_job(module, python)
    assert module[0]["strategy"] == "ddp"  # devices=2 with strategy "auto" on CPU
    assert module[0]["ppid"] == module[1]["ppid"]
    assert python[1]["ppid"] == python[0]["pid"]  # under python, rank 0 started rank 1


def test_lite_run_two_nodes(start_script, free_tcp_port, tmp_path):
    port = str(free_tcp_port())
    nodes = []
    for node in (0, 1):
        out = tmp_path / f"node{node}"
        out.mkdir()
        command = ("-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
                   "--node-rank", str(node), "--main-port", port, "cli_job.py")
        nodes.append(start_script(command[-1], out, python_args=command[:-1]))
    for node in nodes:
        out, err = node.communicate(timeout=90)
        assert node.returncode == 0, f"{out}\n{err}"
    (zero,), (one,) = records(tmp_path / "node0"), records(tmp_path / "node1")
    assert (zero["global_rank"], zero["node_rank"]) == (0, 0)
    assert (one["global_rank"], one["node_rank"]) == (1, 1)
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["losses"] == one["losses"]  # all-reduced across the two "nodes"


def test_explicit_argument_in_code_wins_with_a_warning(run_script, tmp_path, output_of):
    proc = lite_run(run_script, tmp_path, "--accelerator", "cpu", "--devices", "2", "--precision", "bf16-mixed",
                    mode="explicit")
    assert proc.returncode == 0, output_of(proc)
    zero, one = records(tmp_path)
    assert zero["precision"] == one["precision"] == "64-true"  # the code's value
    assert zero["world_size"] == 2  # the command line's devices, which the code left open
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING ")]
    assert len(warnings) == 2, output_of(proc)  # one per rank
    assert all(w.endswith("LITE_PRECISION='bf16-mixed' is ignored because the code passes precision='64-true':"
                          " remove the argument from LightningLite(...) to let the command line or environment"
                          " choose it.") for w in warnings)
    assert all("cli_job.py" in w for w in warnings)  # points at the user's line


def test_failing_rank_ends_the_job_with_its_exit_code(run_script, tmp_path, output_of):
    started = time.monotonic()
    proc = lite_run(run_script, tmp_path, "--max-restarts", "0", "--accelerator", "cpu", "--devices", "2", mode="fail1")
    assert proc.returncode == 7, output_of(proc)
    assert time.monotonic() - started < 60  # not the 20 s collective timeout twice over, nor a hang
    assert "lite run: local rank 1 failed with exit code 7; stopping every rank." in proc.stderr
    assert not records(tmp_path)


def test_the_failing_ranks_traceback_reaches_the_summary_from_torchs_error_file(run_script, tmp_path, output_of):
    # The ranks' output goes to files only: the traceback on the terminal is the one each rank's
    # `record` wrapper wrote into the error file the agent reads.
    logs = tmp_path / "logs"
    proc = run_script(command=[*LITE, "run", "--accelerator", "cpu", "--devices", "2", "--log-dir", str(logs),
                               "--redirects", "3", "reliability_job.py", "ddp", "raise", "1", str(tmp_path)])
    assert proc.returncode == 1, output_of(proc)
    said = proc.stderr.splitlines()
    assert said[0].startswith("lite run: local rank 1 failed") and f"in {logs}" in said[0], output_of(proc)
    assert said[1] == "Traceback (most recent call last):" and said[-1] == "RuntimeError: boom on rank 1"
    assert 'reliability_job.py", line' in proc.stderr


def test_a_configuration_the_script_gets_wrong_is_refused_in_one_line(run_script, tmp_path, output_of):
    # Both ranks refuse the code's devices=3 under --devices 2: the sentence once, no traceback
    # through runpy and torch's `record` from each rank. A user's own exception keeps its
    # traceback (test_the_failing_ranks_traceback_reaches_the_summary_from_torchs_error_file).
    proc = lite_run(run_script, tmp_path, "--accelerator", "cpu", "--devices", "2", mode="devices3")
    assert proc.returncode == 2, output_of(proc)
    assert proc.stderr.splitlines() == [
        "lite run: error: lite run started 2 processes per node but LightningLite(devices=3) asks for 3: make them"
        " agree, e.g. devices=2 or lite run --devices=3."], output_of(proc)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_lite_run_ends_every_rank(start_script, tmp_path, wait_gone, sig):
    proc = start_script("cli_job.py", tmp_path, "hang",
                        python_args=("-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "2"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready_rank*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("ready_rank*"))]

    os.kill(proc.pid, sig)  # to lite run only, not to its process group
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, f"{out}\n{err}"
    assert f"received {sig.name}; stopping every rank." in err
    assert wait_gone(ranks, 10) == []


def test_bad_choice_fails_before_starting_anything(run_script, tmp_path):
    proc = lite_run(run_script, tmp_path, "--strategy", "dpp", "--devices", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lite run: error: strategy='dpp' is not a known strategy: did you mean 'ddp'? valid names are "
        + proc.stderr.split("valid names are ", 1)[1].strip()
    ]
    assert not list(tmp_path.iterdir())


# -- lite env -----------------------------------------------------------------------------------------
def with_path(folder: Path) -> str:
    """PYTHONPATH with `folder` in front of what the tests already run with."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def write_incompatible_backend(root: Path) -> None:
    info = root / "lite_fake_future-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: lite-fake-future\nVersion: 0.0.1\nRequires-Dist: lite-core>=9.0\n")
    (info / "entry_points.txt").write_text(
        "[lite_core.accelerators]\nfuture = lite_fake_future:Accel\n\n"
        "[lite_core.strategies]\nfuture_ddp = lite_fake_future:Strategy\n")
    (root / "lite_fake_future.py").write_text("raise AssertionError('an incompatible backend was imported')\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_available", ["0", "1"])
def test_lite_env_reports_backends_and_their_compatibility(run_script, tmp_path, output_of, fake_available):
    write_incompatible_backend(tmp_path)
    env = {"PYTHONPATH": with_path(tmp_path), "LITE_FAKE_AVAILABLE": fake_available}
    proc = run_script(command=[*LITE, "env", "--json"], env=env)
    assert proc.returncode == 0, output_of(proc)
    report = json.loads(proc.stdout)
    packages = {p["name"]: p for p in report["packages"]}

    import torch

    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["build"] == ("CPU" if torch.version.cuda is None else f"CUDA {torch.version.cuda}")
    assert report["packages"][0]["name"] == "lite-core"
    core = packages["lite-core"]
    assert core["compatible"] and [a["name"] for a in core["accelerators"]] == ["cpu"]
    assert core["accelerators"][0]["available"] is True
    assert {"ddp", "ddp_spawn", "single_device"} <= set(core["strategies"])

    fake = packages["lite-fake-backend"]
    assert fake["version"] == "0.0.1" and fake["compatible"] and fake["problem"] is None
    assert [(a["name"], a["available"]) for a in fake["accelerators"]] == [("fake", fake_available == "1")]
    assert fake["strategies"] == ["fake_broken", "fake_single"]
    assert fake["strategy_problems"]["fake_broken"].startswith("failed to import (ImportError: ")
    assert report["numpy"] and report["memory"]["total_gib"] > 0
    assert report["lite_variables"]["LITE_FAKE_AVAILABLE"] == fake_available

    future = packages["lite-fake-future"]
    assert future["compatible"] is False
    assert future["problem"] == ("lite-fake-future 0.0.1 needs lite-core>=9.0 but lite-core 0.1.0 is installed:"
                                 " run `pip install --upgrade 'lite-core>=9.0'`.")
    assert future["accelerators"] == []  # refused without importing it
    assert future["strategies"] == ["future_ddp"]


@pytest.mark.timeout(60)
def test_lite_env_text_report(run_script, tmp_path, output_of):
    write_incompatible_backend(tmp_path)
    proc = run_script(command=[*LITE, "env"], env={"PYTHONPATH": with_path(tmp_path), "LITE_STRATEGY": "ddp"})
    assert proc.returncode == 0, output_of(proc)
    lines = proc.stdout.splitlines()
    assert lines[0] == "Paste this whole report, from this line on, into your bug report."
    assert lines[2].startswith("Python ")
    assert lines[3].startswith("torch ")
    import numpy

    assert f"numpy         {numpy.__version__}" in lines
    assert any(line.startswith("RAM           ") and line.endswith(" GiB available") for line in lines)
    assert any(line.startswith("LITE_*        ") and "LITE_STRATEGY=ddp" in line for line in lines)
    assert ("mesh          model_parallel: (data_parallel, tensor_parallel); with a pipeline:"
            " (pipeline_parallel, data_parallel, tensor_parallel), schedules GPipe, 1F1B, Interleaved1F1B,"
            " LoopedBFS, InterleavedZeroBubble") in lines
    # A strategy whose dependency is missing says what to install.
    strategies = next(line for line in lines if line.startswith("    strategies: ddp"))
    import importlib.util

    if importlib.util.find_spec("fairscale") is None:
        assert "ddp_sharded (needs fairscale: pip install 'fairscale>=0.4.13')" in strategies
    else:
        assert ", ddp_sharded, " in strategies
    assert ", ddp_spawn," in strategies  # the others are listed plainly
    assert "  lite-core 0.1.0  [compatible]" in lines
    assert "  lite-fake-backend 0.0.1  [compatible]" in lines
    assert any(line.startswith("  lite-fake-future 0.0.1  [INCOMPATIBLE: lite-fake-future 0.0.1 needs lite-core>=9.0")
               for line in lines)
    assert "    accelerator fake: not available - fake (available: False)" in lines
    # The backends Lite knows of that this environment lacks, each with the extra that installs it.
    # What works while Lite is not on the package index: the README's clone route, not `'lite-core[cuda]'`.
    assert "Not installed (the backends Lite knows of; install from a clone of Lite's repository):" in lines
    assert ("  lite-cuda: pip install './packages/lite-core[cuda]' ./packages/lite-cuda  (accelerator cuda, gpu;"
            " strategy dp)") in lines
    assert any(line.startswith("  lite-xla: pip install './packages/lite-core[xla]' ./packages/lite-xla  (accelerator"
                               " tpu, xla; strategy ") for line in lines)
    assert any(line.startswith("  lite-deepspeed: pip install './packages/lite-core[deepspeed]' ./packages/lite-deepspeed"
                               "  (strategy deepspeed, ") for line in lines)


@pytest.mark.timeout(60)
def test_importing_lite_core_does_not_import_the_command_line(run_script, output_of):
    code = "import sys, lite_core; lite_core.LightningLite; print(sorted(m for m in sys.modules if 'cli' in m))"
    proc = run_script(command=[sys.executable, "-c", code])
    assert proc.returncode == 0, output_of(proc)
    assert "lite_core.cli" not in proc.stdout
