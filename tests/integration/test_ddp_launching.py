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


# -- the machine's cores ---------------------------------------------------------------------------
_UNSET_THREADS = ("env", "-u", "OMP_NUM_THREADS")  # as a user who never set it (the tests' env sets 1)


def _threads_job(*args: object, lite_run: tuple[str, ...] = ()) -> list[str]:
    runner = [sys.executable, "-m", "lite_core.cli", "run", *lite_run] if lite_run else [sys.executable]
    return [*_UNSET_THREADS, *runner, "threads_job.py", *map(str, args)]


@pytest.mark.timeout(300)  # a hang guard: three jobs, about 15 s on an idle machine
def test_every_launcher_gives_each_rank_the_same_threads(run_script, tmp_path, output_of):
    # torch's agent (lite run, torchrun) gives each of several ranks on a node one thread unless the
    # user set OMP_NUM_THREADS; Lite's own launchers left torch's default (one per core), so under
    # `python train.py` 2 ranks on 2 cores oversubscribed them and ran 3-5x slower.
    for command in (_threads_job(tmp_path, "python", "ddp"), _threads_job(tmp_path, "python", "ddp_spawn", "ddp_fork"),
                    _threads_job(tmp_path, "lite-run", "ddp", lite_run=("--devices", "2"))):
        proc = run_script(command=command)
        assert proc.returncode == 0, output_of(proc)
    seen = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert sorted(seen) == [f"{job}-rank{rank}" for job in ("lite-run-ddp", "python-ddp", "python-ddp_fork",
                                                              "python-ddp_spawn") for rank in (0, 1)]
    assert all(record == {"threads": 1, "variable": "1"} for record in seen.values()), seen


def test_more_ranks_than_cores_warn_once_and_the_users_threads_stay(run_script, tmp_path, output_of):
    # The job pins itself to one core and starts 2 ranks (fork: the parent's thread pool is
    # inherited, so Lite would have to reset it; the user's OMP_NUM_THREADS=2 must win).
    proc = run_script("threads_job.py", tmp_path, "mine", "ddp_fork", "--one-core", env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, output_of(proc)
    lines = proc.stderr.splitlines()
    warnings = [number for number, line in enumerate(lines) if "UserWarning" in line]
    assert len(warnings) == 1, output_of(proc)
    where, said = lines[warnings[0]].split(": UserWarning: ")
    assert said == ("2 processes share this machine's 1 usable CPU core(s), so each computes slower than on a core"
                    " of its own: start at most 1 (devices=1) for the fastest steps.")
    assert where.startswith(f"{SCRIPTS / 'threads_job.py'}:") and "job.run(" in lines[warnings[0] + 1]  # the launch
    seen = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("*.json"))]
    assert seen == [{"threads": 2, "variable": "2"}] * 2


def test_devices_far_above_the_cores_are_refused_before_any_process_starts(run_script, tmp_path, output_of):
    cores = len(os.sched_getaffinity(0))
    sentence = (f"devices=1000 would start 1000 processes on this machine, which has {cores} usable CPU core(s): pass"
                f" devices={max(4 * cores, 8)} or fewer (at most 4 processes per core), or run on a machine with more"
                " cores.")
    # Under python: Python's own traceback (the process is the user's), ending in the sentence.
    proc = run_script("threads_job.py", tmp_path, "python", "ddp", "--devices", 1000)
    assert proc.returncode == 1, output_of(proc)
    assert proc.stderr.count("Traceback") == 1 and proc.stderr.splitlines()[-1] == (
        f"lite_core.errors.ConfigurationError: {sentence}"), output_of(proc)
    # Under lite run: refused with its options, in one line.
    proc = run_script(command=[sys.executable, "-m", "lite_core.cli", "run", "--devices", "1000", "threads_job.py",
                               str(tmp_path), "lite-run", "ddp"])
    assert proc.returncode == 2, output_of(proc)
    assert proc.stderr.splitlines() == [f"lite run: error: {sentence}"]
    assert not list(tmp_path.iterdir())
