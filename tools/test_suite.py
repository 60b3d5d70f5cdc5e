"""Run every test environment of the workspace (`hatch run <env>:all`) and summarise the cells.

Test environments are the hatch environments whose name is `test` or starts with `test-`.
`python tools/test_suite.py` runs them all; `python tools/test_suite.py test-cuda` runs one.
Exits non-zero if any environment failed (one that collects no test fails too: pytest exits 5),
or, when every environment ran, if a matrix cell passed in none of them (skipped or deselected
everywhere): only cells that need hardware absent from this machine (CUDA) may, and the report
lists those by name with the reason.

While the first environment runs, the others are created in the background (low priority, one
at a time): creating them waits mostly on downloads and the disk. The environments whose tests
mostly wait rather than compute (`test-packaging`: wheel builds and pip installs into a fresh
venv; `test-cuda`: mostly skips on a CPU machine; `test-ray`, `test-torchft` and `test-trackers`:
clusters, lighthouses, heartbeats, tracking servers), and `test-deepspeed` to even the lanes, run one after another in a second lane beside the others, their output kept in logs that
are printed when each ends, so that the two lanes take about as long. Two tables follow the run:
one row per environment (exit code, seconds) and the whole run's time, then the matrix
(`tests/matrix`): per cell and environment, passed, skipped (with the reason, as a numbered
note), xfail or FAILED. Each environment's pytest writes a JUnit XML report into a temporary
folder (through `PYTEST_ADDOPTS`), which the second table reads.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import IO

#: JUnit class names of the matrix's tests (pytest's importlib mode names them by path).
_MATRIX_PREFIX = "tests.matrix."
_MATRIX_DIR = Path(__file__).resolve().parents[1] / "tests" / "matrix"
#: Outcomes that count as a cell having run.
_RAN = ("passed", "xfail")


def test_environments() -> list[str]:
    """Names of the test environments hatch knows, in the order hatch.toml declares them."""
    shown = subprocess.run(["hatch", "env", "show", "--json"], check=True, capture_output=True, text=True)
    return [name for name in json.loads(shown.stdout) if name == "test" or name.startswith("test-")]


#: Environments whose tests wait (on `hatch build`, pip, a Ray cluster's start, a lighthouse's
#: heartbeats, an MLflow server's start) more than they compute: they run one after another in a lane beside the others,
#: rather than after them (about 3 minutes of the fresh-clone run). The lanes are evened out by
#: hand: in a fresh clone of 362b9cc beside a busy loop this lane (with `test-deepspeed` then)
#: took 1558 s and the serial environments 1502 s; the elastic chaos job then moved from `test` to
#: `test-trackers`, and `test-deepspeed` to the serial lane. With `test-cuda` there too, a loaded
#: fresh clone of 5d28f32 took 2225 s in the serial lane and 1895 s in this one; `test-cuda`
#: (135 s there, mostly skips) came back here. At stop 67 `test-torchft` went from about 850 s to
#: 255 s (forked from the fork server) and `test` lost about 300 CPU-seconds (more preloads), so
#: `test-deepspeed` (260-420 s) came back to this lane, last.
BESIDE = ("test-packaging", "test-torchft", "test-ray", "test-trackers", "test-cuda", "test-deepspeed")


def run_cell(env: str, report: Path | None = None, log: Path | None = None) -> tuple[int, float, float]:
    """Run one environment's `all` script; returns its exit code, its duration in seconds and the
    CPU-seconds (user + system) of its process tree (every descendant that its parent waited for).

    With `report`, its pytest writes a JUnit XML report there; with `log`, its output goes to
    that file instead of this process's output.
    """
    if log is None:
        print(f"\n===== {env} =====", flush=True)
    child_env = dict(os.environ)
    if report is not None:
        child_env["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} --junitxml={report}".strip()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        output = None if log is None else stack.enter_context(log.open("w"))
        code, cpu = run_with_cpu(["hatch", "run", f"{env}:all"], child_env, output)
    return code, time.monotonic() - started, cpu


def run_with_cpu(command: list[str], env: dict[str, str], output: IO[str] | None) -> tuple[int, float]:
    """Run `command`; its exit code and the CPU-seconds (user + system) that it and every
    descendant it waited for used (`wait4`'s resource usage of the child)."""
    process = subprocess.Popen(command, env=env, stdout=output, stderr=None if output is None else subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_utime + usage.ru_stime


def _matrix_cases(report: Path) -> list[ElementTree.Element]:
    """The matrix tests' `testcase` elements in one JUnit report (none if it does not exist)."""
    if not report.is_file():
        return []
    return [case for case in ElementTree.parse(report).iter("testcase")
            if case.get("classname", "").startswith(_MATRIX_PREFIX)]


def matrix_outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """`{test id: (outcome, reason)}` of the matrix tests in one JUnit report (empty if none)."""
    return {_without_group(case.get("name", "")): _outcome(case) for case in _matrix_cases(report)}


def _without_group(name: str) -> str:
    """A test's name without the `@group` that pytest-xdist's `--dist loadgroup` appends to it
    (`test_x[cell]@matrix:cell` -> `test_x[cell]`), so that every environment names a test alike."""
    at = name.rfind("@")
    return name[:at] if at > name.rfind("]") else name


def matrix_seconds(report: Path) -> float:
    """How long the matrix tests of one JUnit report took (0 if none ran)."""
    return sum(float(case.get("time", 0)) for case in _matrix_cases(report))


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    for child in case:
        message = child.get("message", "").strip()
        if child.tag == "skipped":
            return ("xfail", message) if child.get("type") == "pytest.xfail" else ("skipped", message)
        if child.tag in ("failure", "error"):
            return "FAILED", message.splitlines()[0] if message else ""
    return "passed", ""


def matrix_table(outcomes: dict[str, dict[str, tuple[str, str]]]) -> list[str]:
    """Markdown lines: one row per matrix test, one column per environment that ran matrix tests
    (e.g. not test-packaging), reasons as notes."""
    envs = [env for env, per_env in outcomes.items() if per_env]
    # The training cells first, then the checkpoint moves.
    tests = sorted({test for per_env in outcomes.values() for test in per_env},
                   key=lambda test: (test.startswith("test_resume"), test))
    if not tests:
        return []
    notes: dict[str, int] = {}
    lines = [f"| matrix cell | {' | '.join(envs)} |", f"| --- |{' --- |' * len(envs)}"]
    for test in tests:
        cells = []
        for env in envs:
            outcome, reason = outcomes[env].get(test, ("not run", ""))
            if reason:
                number = notes.setdefault(reason, len(notes) + 1)
                outcome = f"{outcome} [{number}]"
            cells.append(outcome)
        lines.append(f"| {_short(test)} | {' | '.join(cells)} |")
    lines.append("")
    lines += [f"[{number}] {reason}" for reason, number in notes.items()]
    return lines


def matrix_tests() -> dict[str, bool]:
    """Every matrix test id the cells declare, and whether it needs hardware this machine lacks
    (a CUDA device: such a test may skip in every environment). Reads `tests/matrix/cells.py`."""
    sys.path.insert(0, str(_MATRIX_DIR))
    try:
        import cells
    finally:
        sys.path.remove(str(_MATRIX_DIR))
    tests = {f"{test}[{c.id}]": _needs_absent_hardware(c) for test in _PER_CELL for c in cells.CELLS}
    for move in cells.RESUMES:
        hardware = _needs_absent_hardware(move.saved_by) or _needs_absent_hardware(move.resumed_by)
        tests[f"test_resume_under_another_strategy[{move.id}]"] = hardware
    return tests


def _needs_absent_hardware(cell: object) -> bool:
    return getattr(cell, "accelerator", None) == "cuda" and not glob.glob("/dev/nvidia[0-9]*")


def unrun_tests(outcomes: dict[str, dict[str, tuple[str, str]]], declared: dict[str, bool]
                ) -> tuple[list[str], list[str]]:
    """(tests that ran in no environment although this machine could run them, tests that need
    absent hardware and ran nowhere), each as `test: why` lines."""
    refused, excused = [], []
    for test, hardware in declared.items():
        seen = [per_env[test] for per_env in outcomes.values() if test in per_env]
        if any(outcome in _RAN for outcome, _ in seen):
            continue
        reasons = sorted({reason for outcome, reason in seen if reason}) or ["deselected or not collected"]
        (excused if hardware else refused).append(f"{_short(test)}: {'; '.join(reasons)}")
    return refused, excused


#: The matrix tests run once per training cell, and their short names in the table.
_PER_CELL = {"test_training_matches_plain_pytorch": "train",
             "test_a_failed_save_raises_on_every_rank": "failed save",
             "test_gradient_accumulation_matches_plain_pytorch": "accumulation"}


def _short(test: str) -> str:
    """`test_training_matches_plain_pytorch[ddp-2-32-true]` -> `train ddp-2-32-true`."""
    name, _, cell = test.partition("[")
    kind = "resume" if "resume" in name else _PER_CELL.get(name, name)
    return f"{kind} {cell.rstrip(']')}" if cell else name


class EnvironmentBuilder:
    """Creates the later environments in the background while the first one runs its tests.

    Creating an environment mostly waits on downloads and the disk (test-xla fetches about 4 GB),
    so doing it beside the first environment's CPU-bound tests saves most of that wait. The
    builder runs at low priority, one environment at a time, into its own log file.
    """

    def __init__(self, envs: list[str], log: Path) -> None:
        self._done = {env: threading.Event() for env in envs}
        self._log = log
        self._thread = threading.Thread(target=self._build, args=(envs,), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, env: str) -> None:
        """Block until `env` was created (or its creation failed: `hatch run` then says why)."""
        if env in self._done:
            self._done[env].wait()

    def _build(self, envs: list[str]) -> None:
        with self._log.open("w") as log:
            for env in envs:
                subprocess.run(["hatch", "env", "create", env], stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=lambda: os.nice(10))
                self._done[env].set()


class BesideLane:
    """Runs environments one after another in a thread beside the serial ones, each once the
    builder created it."""

    def __init__(self, envs: list[str], builder: EnvironmentBuilder, reports: dict[str, Path], folder: Path) -> None:
        self.envs = envs
        self._builder, self._reports, self._folder = builder, reports, folder
        self._results: dict[str, tuple[int, float, float]] = {env: (1, 0.0, 0.0) for env in envs}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _log(self, env: str) -> Path:
        return self._folder / f"{env}.log"

    def _run(self) -> None:
        for env in self.envs:
            self._builder.wait_for(env)
            self._results[env] = run_cell(env, self._reports[env], self._log(env))

    def finish(self) -> dict[str, tuple[int, float, float]]:
        """Wait for the lane to end, print each environment's output, and return their exit codes,
        seconds and CPU-seconds."""
        self._thread.join()
        for env in self.envs:
            print(f"\n===== {env} (ran beside the others) =====", flush=True)
            if self._log(env).is_file():
                print(self._log(env).read_text(errors="replace"), end="", flush=True)
        return self._results


def main(argv: list[str]) -> int:
    started = time.monotonic()
    envs = argv or test_environments()
    beside = [env for env in BESIDE if env in envs and len(envs) > 1]  # the lane in BESIDE's order
    serial = [env for env in envs if env not in beside]
    with tempfile.TemporaryDirectory(prefix="lite-suite-") as folder:
        reports = {env: Path(folder, f"{env}.xml") for env in envs}
        # The environments that run beside are created first, so that they start at once.
        builder = EnvironmentBuilder(beside + serial[1:], Path(folder, "environments.log"))
        builder.start()
        lane = BesideLane(beside, builder, reports, Path(folder))
        lane.start()
        finished = {}
        for env in serial:
            builder.wait_for(env)
            finished[env] = run_cell(env, reports[env])
        finished.update(lane.finish())
        results = {env: finished[env] for env in envs}  # the table keeps hatch.toml's order
        outcomes = {env: matrix_outcomes(reports[env]) for env in envs}
        matrix_time = {env: matrix_seconds(reports[env]) for env in envs}
    print("\n| environment | result | seconds | CPU-seconds | matrix tests (s, summed over workers) |"
          "\n| --- | --- | ---: | ---: | ---: |")
    for env, (code, seconds, cpu) in results.items():
        result = "passed" if code == 0 else f"FAILED (exit {code})"
        print(f"| {env} | {result} | {seconds:.0f} | {cpu:.0f} | {matrix_time[env]:.0f} |")
    print(f"| all (environments created in the background included) | | {time.monotonic() - started:.0f} | | |")
    table = matrix_table(outcomes)
    if table:
        print("\n" + "\n".join(table))
    refused: list[str] = []
    if not argv:  # every environment ran: each cell this machine can run must have run somewhere
        refused, excused = unrun_tests(outcomes, matrix_tests())
        if excused:
            print("\nSkipped everywhere, as they need hardware this machine lacks:\n" + "\n".join(f"- {t}" for t in excused))
        if refused:
            print("\nFAILED: matrix cells that no environment ran:\n" + "\n".join(f"- {t}" for t in refused))
    return 0 if all(code == 0 for code, _, _ in results.values()) and not refused else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
