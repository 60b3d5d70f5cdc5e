"""The test session's fork server (tools/forkserver): a `python` that a test starts runs forked
from a process that has imported torch, and behaves as a fresh interpreter would: its command
line, exit code or signal, traceback, parent, signals, descriptors, threads, and the death of its
launcher. What it cannot mirror starts as a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

pytestmark = [
    pytest.mark.timeout(120),  # a hang guard: each case starts one or two processes of about a second
    pytest.mark.skipif(os.environ.get("LITE_TEST_FORKSERVER", "0") == "0",
                       reason="LITE_TEST_FORKSERVER=0 runs every process as a fresh interpreter"),
]

#: Prints whether the program began with torch already imported (only a forked one does).
FORKED = "import sys; print('forked' if 'torch' in sys.modules else 'fresh')"


def _python(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, **kwargs)


def test_a_python_a_test_starts_is_forked_and_sees_its_own_command_line(tmp_path: Path) -> None:
    script = tmp_path / "link" / "prog.py"
    real = tmp_path / "real"
    real.mkdir()
    (real / "prog.py").write_text(f"{FORKED}\nimport os\nprint(__name__, sys.argv, __file__ == os.path.abspath(sys.argv[0]), sys.path[0])\n")
    (tmp_path / "link").symlink_to(real)
    proc = _python(str(script), "a", "--b", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["forked", f"__main__ {[str(script), 'a', '--b']} True {real.resolve()}"]


def test_module_code_and_standard_input_programs_run_as_python_runs_them(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(f"{FORKED}\nimport sys; print(__name__, sys.argv[1:])\n")
    assert _python("-m", "mod", "x", cwd=tmp_path).stdout.splitlines() == ["forked", "__main__ ['x']"]
    assert _python("-c", f"{FORKED}; print(sys.argv)", "y").stdout.splitlines() == ["forked", "['-c', 'y']"]
    proc = _python("-", "z", input=f"{FORKED}; print(sys.argv, sys.stdin.read())")
    assert proc.stdout.splitlines() == ["forked", "['-', 'z'] "]


def test_exit_codes_signals_and_tracebacks_are_the_programs() -> None:
    assert _python("-c", "raise SystemExit(7)").returncode == 7
    assert _python("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -signal.SIGTERM
    proc = _python("-c", "def f():\n    raise ValueError('boom')\nf()")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "Traceback (most recent call last):", '  File "<string>", line 3, in <module>',
        '  File "<string>", line 2, in f', "ValueError: boom"]


def test_the_parent_and_the_descriptors_are_the_ones_the_launcher_gave() -> None:
    read_end, write_end = os.pipe()
    code = f"{FORKED}; import os; os.write({write_end}, str(os.getppid()).encode())"
    proc = subprocess.run([sys.executable, "-c", code], pass_fds=[write_end], capture_output=True, text=True,
                          timeout=60)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        assert (proc.stdout.strip(), reader.read()) == ("forked", str(os.getpid()))


def test_each_program_draws_its_own_random_seeds() -> None:
    code = f"{FORKED}; import random, numpy, torch; print(torch.initial_seed(), numpy.random.randint(1 << 30), random.random())"
    first, second = (_python("-c", code).stdout.split() for _ in range(2))
    assert first[0] == second[0] == "forked"
    assert all(a != b for a, b in zip(first[1:], second[1:])), (first, second)


def test_the_thread_count_follows_omp_num_threads() -> None:
    code = f"{FORKED}; import torch; print(torch.get_num_threads())"
    for threads in ("1", "2"):
        proc = _python("-c", code, env={**os.environ, "OMP_NUM_THREADS": threads})
        assert proc.stdout.split() == ["forked", threads]


def test_a_signal_to_the_process_the_launcher_holds_reaches_the_program() -> None:
    code = textwrap.dedent(f"""
        {FORKED}
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(3)))
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "forked"
    assert proc.stdout.readline().strip() == "ready"
    proc.terminate()
    assert proc.wait(timeout=60) == 3
    assert proc.stdout.read().strip() == "terminated"


def test_a_killed_stand_in_takes_its_program_with_it(wait_gone: Callable[[list[int], float], list[int]]) -> None:
    code = f"{FORKED}; import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "forked"
    program = int(proc.stdout.readline())
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert wait_gone([program], 60) == []  # a hang guard: the kill is at once


def test_an_armed_parent_death_signal_fires_when_the_launcher_dies(wait_gone: Callable[[list[int], float], list[int]]
                                                                 ) -> None:
    """What Lite's ranks arm (supervision.die_with_parent): the launcher killed, the rank goes."""
    rank = textwrap.dedent(f"""
        {FORKED}
        import ctypes, os, signal, time
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", {rank!r}], stdout=subprocess.PIPE, text=True)
        print(rank.stdout.readline().strip(), rank.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    forked, pid = proc.stdout.readline().split()
    assert forked == "forked"
    proc.kill()
    proc.wait(timeout=60)
    assert wait_gone([int(pid)], 60) == []  # a hang guard: the kill is at once


def test_a_program_whose_launcher_died_is_seen_until_it_ends(wait_gone: Callable[[list[int], float], list[int]]
                                                             ) -> None:
    """Unarmed, it lives on as an orphan would, and its stand-in (the pid its launcher had) too."""
    program = textwrap.dedent(f"""
        {FORKED}
        import os, sys, time
        print(os.getpid(), flush=True)
        sys.stdin.readline()  # until the test says so
    """)
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", {program!r}], stdout=subprocess.PIPE, text=True)
        print(rank.pid, rank.stdout.readline().strip(), rank.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stand_in, forked, pid = proc.stdout.readline().split()
    assert forked == "forked"
    proc.kill()
    proc.wait(timeout=60)
    time.sleep(0.5)  # what the test shows: after a while, both are still there (not a race bound)
    assert wait_gone([int(pid), int(stand_in)], 0) == [int(pid), int(stand_in)]  # both still alive
    proc.stdin.write("end\n")
    proc.stdin.close()
    assert wait_gone([int(pid), int(stand_in)], 60) == []


#: A program that starts a child and prints its own pid and the child's, then waits.
GROUPED_JOB = f"""{FORKED}
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
print(os.getpid(), os.getpgid(0) == os.getpid(), child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_job_a_test_signals_as_a_group_is_forked_and_the_groups_signal_reaches_what_it_started(
        wait_gone: Callable[[list[int], float], list[int]], sig: int) -> None:
    # A process-group leader (a job started with start_new_session, a rank torch's elastic agent
    # starts): forked, leading a group of its own whose signal reaches its children too.
    proc = subprocess.Popen([sys.executable, "-c", GROUPED_JOB], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "forked"
        program, leads, child = proc.stdout.readline().split()
        assert leads == "True"
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=60) == -sig
        assert wait_gone([int(program), int(child)], 60) == []  # a hang guard: the signal is at once
    finally:
        proc.kill()


def test_a_group_for_cleanup_only_is_forked_and_its_kill_ends_the_program(
        wait_gone: Callable[[list[int], float], list[int]]) -> None:
    code = f"{FORKED}; import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    env = {**os.environ, "LITE_TEST_FORKSERVER_CLEANUP_GROUP": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "forked"
    program = int(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGKILL)  # the cleanup: the group's leader is the stand-in
    proc.wait(timeout=60)
    assert wait_gone([program], 60) == []  # a hang guard: the kill is at once


def test_what_a_fork_cannot_mirror_starts_a_fresh_interpreter() -> None:
    assert _python("-X", "importtime", "-c", FORKED).stdout.strip() == "fresh"
    assert _python("-c", FORKED, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "INFO"}).stdout.strip() == "fresh"
    assert _python("-c", FORKED, env={**os.environ, "LITE_TEST_FORKSERVER": "0"}).stdout.strip() == "fresh"
