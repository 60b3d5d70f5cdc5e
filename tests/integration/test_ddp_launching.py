"""Ways of starting a 2-process job: `launch()`, an interactive session, several nodes by hand,
torchrun, and two jobs side by side."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def records(out_dir: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob(pattern))]


def result_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT "):])


# -- launch() ------------------------------------------------------------------------------------
def test_launch_function_returns_rank_zero_value(run_script, tmp_path, output_of):
    proc = run_script("launch_styles.py", "function", tmp_path)
    assert proc.returncode == 0, output_of(proc)
    zero, one = records(tmp_path, "rank*.json")
    (caller,) = records(tmp_path, "caller_*.json")
    assert (zero["rank"], one["rank"]) == (0, 1)
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["total"] == one["total"] == 15.0  # 5 * 1 + 5 * 2: the function got n=5 on both ranks
    assert zero["ppid"] == one["ppid"] == caller["pid"]  # spawned by the calling process
    assert caller["returned"] == zero  # rank 0's return value, handed back to the caller


def test_launch_without_function_under_ddp(run_script, tmp_path, output_of):
    proc = run_script("launch_styles.py", "bare", tmp_path)
    assert proc.returncode == 0, output_of(proc)
    zero, one = records(tmp_path, "rank*.json")
    callers = records(tmp_path, "caller_*.json")
    # The code after launch() ran in both processes: the original one (rank 0) and its re-run.
    assert sorted(c["pid"] for c in callers) == sorted([zero["pid"], one["pid"]])
    assert all(c["returned"] is None for c in callers)
    assert zero["ppid"] == os.getpid() and one["ppid"] == zero["pid"]
    assert (zero["rank"], one["rank"]) == (0, 1)
    assert zero["total"] == one["total"] == 15.0
    assert zero["broadcast"] == one["broadcast"] == {"pid_of_rank0": zero["pid"]}
    assert zero["dist_initialized"] and one["dist_initialized"]


# -- interactive session ---------------------------------------------------------------------------
NOTEBOOK_CODE = (SCRIPTS / "notebook_session.py").read_text()


@pytest.mark.parametrize("strategy", ["ddp_notebook", "auto"])
def test_ddp_notebook_from_interactive_session(strategy, run_script, output_of):
    # strategy="auto" with devices=2 picks the launcher that works where the script cannot be re-run: fork.
    proc = run_script(command=[sys.executable, "-", strategy], input=NOTEBOOK_CODE)
    assert proc.returncode == 0, output_of(proc)
    assert "STRATEGY DDPForkStrategy" in proc.stdout
    result = result_line(proc.stdout)
    returned = result["returned"]
    assert returned["rank"] == 0 and returned["world_size"] == 2
    assert returned["total"] == 30.0  # 10 * 1 + 10 * 2
    # Two forked workers, both children of the session, which got rank 0's value back.
    assert len(set(returned["pids"])) == 2 and result["session_pid"] not in returned["pids"]
    assert returned["parents"] == [result["session_pid"]] * 2


@pytest.mark.parametrize("strategy", ["ddp", "my_ddp"])
def test_ddp_from_interactive_session_points_to_ddp_notebook(strategy, run_script, output_of):
    proc = run_script(command=[sys.executable, "-", strategy], input=NOTEBOOK_CODE)
    assert proc.returncode != 0, output_of(proc)
    assert "RESULT" not in proc.stdout
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("lite_core.errors.MisuseError:"), output_of(proc)
    assert "ddp_notebook" in error
    assert f"strategy={strategy!r} starts the other ranks" in error  # the strategy the user chose


@pytest.mark.parametrize("strategy", ["ddp", "my_ddp", "ddp_spawn"])
def test_a_ddp_strategy_on_one_device_launches_nothing(strategy, run_script, output_of):
    # e.g. a backend's DeepSpeed strategy on one GPU: it works from stdin and notebooks too.
    proc = run_script(command=[sys.executable, "-", strategy, "1"], input=NOTEBOOK_CODE)
    assert proc.returncode == 0, output_of(proc)
    result = result_line(proc.stdout)
    assert result["returned"]["world_size"] == 1 and result["returned"]["total"] == 10.0
    assert result["returned"]["pids"] == [result["session_pid"]]  # ran in the session itself


def test_ddp_spawn_without_a_main_guard_names_the_guard(run_script, output_of):
    proc = run_script("unguarded_spawn.py")
    assert proc.returncode != 0, output_of(proc)
    assert "RESULT" not in proc.stdout
    error = proc.stderr.strip().splitlines()[-1]
    assert error == ("lite_core.errors.MisuseError: strategy='ddp_spawn' starts each rank by importing your"
                     " script, which would start training again in every rank: put the code that runs it under"
                     " `if __name__ == \"__main__\":`."), output_of(proc)
    assert "bootstrapping" not in proc.stderr and len(proc.stderr.splitlines()) < 25  # one traceback, no ranks'


# -- several nodes, by hand ------------------------------------------------------------------------
def test_two_nodes_on_loopback(start_script, free_tcp_port, tmp_path):
    port = str(free_tcp_port())
    nodes = [
        start_script("tiny_ddp.py", tmp_path, 1, 2,
                     env={"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        for node in (0, 1)
    ]
    for node in nodes:
        out, err = node.communicate(timeout=90)
        assert node.returncode == 0, f"{out}\n{err}"
    zero, one = records(tmp_path, "rank*.json")
    assert len(records(tmp_path, "process_*.json")) == 2  # one process per node, nothing re-run
    assert (zero["global_rank"], one["global_rank"]) == (0, 1)
    assert (zero["node_rank"], one["node_rank"]) == (0, 1)
    assert zero["local_rank"] == one["local_rank"] == 0
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["sum"] == one["sum"] == 31.0  # (10 * 1 + 0) + (10 * 2 + 1)
    assert zero["gathered"] == one["gathered"] == [[0, 0, 0, zero["pid"]], [1, 1, 0, one["pid"]]]


# -- torchrun --------------------------------------------------------------------------------------
def test_torchrun_starts_the_processes(run_script, free_tcp_port, tmp_path, output_of):
    proc = run_script("tiny_ddp.py", tmp_path, 2, 1, python_args=(
        "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_tcp_port()}"))
    assert proc.returncode == 0, output_of(proc)
    started = records(tmp_path, "process_*.json")
    zero, one = records(tmp_path, "rank*.json")
    # Exactly torchrun's 2 workers ran the script: Lite started no process of its own.
    assert len(started) == 2
    assert sorted(p["pid"] for p in started) == sorted([zero["pid"], one["pid"]])
    agent = started[0]["ppid"]
    assert all(p["ppid"] == agent for p in started) and agent not in (zero["pid"], one["pid"])
    for record in (zero, one):
        assert record["environment"] == "torchelastic"
        assert record["global_rank"] == int(record["env"]["RANK"])
        assert record["local_rank"] == int(record["env"]["LOCAL_RANK"])
        assert record["world_size"] == 2
        assert record["sum"] == 21.0  # (10 + 0) + (10 + 1)


# -- two jobs at once ------------------------------------------------------------------------------
def test_two_jobs_at_once_do_not_collide(start_script, tmp_path):
    folders = [tmp_path / "job_a", tmp_path / "job_b"]
    for folder in folders:
        folder.mkdir()
    jobs = [start_script("tiny_ddp.py", folder, 2, 1) for folder in folders]  # no MASTER_PORT set
    for job in jobs:
        out, err = job.communicate(timeout=90)
        assert job.returncode == 0, f"{out}\n{err}"
    ports = []
    for folder in folders:
        zero, one = records(folder, "rank*.json")
        assert len(records(folder, "process_*.json")) == 2
        assert (zero["global_rank"], one["global_rank"]) == (0, 1)
        assert zero["sum"] == one["sum"] == 21.0  # only this job's two ranks took part
        assert zero["env"]["MASTER_PORT"] == one["env"]["MASTER_PORT"]
        ports.append(zero["env"]["MASTER_PORT"])
    assert ports[0] != ports[1]
