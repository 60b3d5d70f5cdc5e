"""Fixtures every test of the repository can use (pytest loads this file for `tests/` and for
each package's `tests/`): the multi-process helpers and a process environment free of launcher
variables.

A multi-process test runs a small user script (from `tests/scripts/` unless it gives a path) as a
real `python` program (2 ranks over gloo on CPU), with a short collective timeout so that a broken
job fails fast instead of hanging.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

SCRIPTS = Path(__file__).resolve().parent / "tests" / "scripts"
#: Seconds a single script may run before the test gives up on it.
SCRIPT_TIMEOUT = 90
#: Lite's collective timeout (seconds) inside the scripts; read by DDPStrategy.
COLLECTIVE_TIMEOUT = "20"

# Variables a launcher, a scheduler or `lite run` around pytest could have set; they would change
# which cluster environment and settings Lite picks, so neither the tests nor their scripts see them.
_LAUNCHER_NAMES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "LITE_ACCELERATOR", "LITE_STRATEGY",
    "LITE_DEVICES", "LITE_NUM_NODES", "LITE_PRECISION", "LITE_GLOBAL_SEED", "LITE_SEED_WORKERS",
    "LITE_FAILURE_DIR", "LITE_FAKE_AVAILABLE", "LITE_RESTART_COUNT", "LITE_MAX_RESTARTS",
})
_LAUNCHER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "KUBERNETES_")


#: Where the session's fork server listens (tools/forkserver); "0" turns it off.
_FORK_SERVER = "LITE_TEST_FORKSERVER"
_fork_server: list[Any] = []


def _forkserver_module() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tools" / "forkserver"))
    try:
        import lite_forkserver
    finally:
        del sys.path[0]
    return lite_forkserver


def pytest_configure(config: pytest.Config) -> None:
    """Start the fork server of this test environment (tools/forkserver/lite_forkserver.py): every
    `python` a test starts, directly or through a launcher, is forked from one process that has
    imported torch, instead of importing it again (1.5-3 CPU-seconds each, CI's main cost). A
    pytest-xdist worker, a nested pytest and every subprocess inherit the variable and so the server.
    `LITE_TEST_FORKSERVER=0` runs every process as a fresh interpreter."""
    import importlib.util

    if _FORK_SERVER in os.environ or sys.prefix == sys.base_prefix or importlib.util.find_spec("torch") is None:
        return  # turned off or already running, not a virtual environment, or nothing to preload
    import tempfile

    lite_forkserver = _forkserver_module()
    folder = tempfile.mkdtemp(prefix="lite-forkserver-")
    try:
        server, path = lite_forkserver.start(folder, dict(os.environ))
    except RuntimeError as error:  # slower, not wrong: say so where the run's output shows it
        sys.stderr.write(f"{error}; every process starts as a fresh interpreter\n")
        return
    _fork_server.extend([server, folder])
    os.environ[_FORK_SERVER] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _fork_server:
        return
    import shutil

    server, folder = _fork_server
    _forkserver_module().stop(server)
    log = Path(folder) / "server.log"
    if log.exists() and log.read_text().strip():  # a preload it skipped, say
        sys.stderr.write(f"fork server: {log.read_text().strip()}\n")
    if not os.environ.get("LITE_TEST_FORKSERVER_DEBUG"):
        shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(_FORK_SERVER, None)
    _fork_server.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n N --dist loadgroup`) a worker takes whole groups: a test that no
    conftest grouped (tests/matrix groups by the run its tests share) is grouped with its module,
    so the module's module-scoped runs happen once. xdist hands out the groups largest first.

    `tryfirst`: xdist turns the groups into node ids in its own hook, which pluggy calls before
    this file's (an initial conftest, registered before the worker's plugin) unless this one
    asks to go first; without it every module's tests were spread over both workers, and a
    module-scoped job (a ZeRO-3 run of 40 s) ran on each. tests/matrix/conftest.py's hook, also
    `tryfirst` and registered later, still runs before this one."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With `LITE_TEST_CPU_LOG=<folder>`, each test's CPU-seconds (this process's and those of the
    children it waited for: a script's ranks count through the script) and wall seconds are
    appended to `<folder>/<worker>.tsv`; `python tools/cpu_report.py <folder>` sums them per module.
    It tells where the suite's CPU goes, which is what CI's time is made of. A program forked from
    the fork server is the server's child, not the test's: the server logs its CPU-seconds under
    the test's id (`LITE_TEST_NODEID`, set here while the test runs), as a row of its own."""
    folder = os.environ.get("LITE_TEST_CPU_LOG")
    if not folder:
        yield
        return
    os.environ["LITE_TEST_NODEID"] = item.nodeid
    before, started = os.times(), time.monotonic()
    try:
        yield
    finally:
        os.environ.pop("LITE_TEST_NODEID", None)
    after = os.times()
    cpu = sum(after[:4]) - sum(before[:4])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(folder) / f"{worker}.tsv", "a") as log:
        log.write(f"{item.nodeid}\t{cpu:.2f}\t{time.monotonic() - started:.2f}\n")


@pytest.fixture(autouse=True)
def _main_module_as_under_python_m_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pytest-xdist worker's `__main__` is execnet's bootstrap (no file, no module), where the
    serial run's is `python -m pytest`'s, a module Lite could run again; give the worker pytest's
    spec so that Lite decides what it decides in the serial run (e.g. `strategy="auto"` picks the
    script-rerunning `ddp`, not `ddp_fork`). A test of the REPL or notebook case patches `__main__`
    itself."""
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None and not getattr(main, "__file__", None):
        import importlib.util

        monkeypatch.setattr(main, "__spec__", importlib.util.find_spec("pytest.__main__"), raising=False)


@pytest.fixture(autouse=True)
def _process_group_ends_with_its_test() -> Any:
    """A one-process `ddp` or `fsdp` run inside the pytest process keeps its process group until
    the process exits (Lite tears down at exit), where a later test of the same worker would find
    it: the Ray environment, for one, reads its ranks from an existing group. Each test leaves none."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _set_by_a_launcher(name: str) -> bool:
    return name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test as a plain local process: the launcher variables of the host (which may be
    inside a scheduler) are removed for its duration."""
    for name in list(os.environ):
        if _set_by_a_launcher(name):
            monkeypatch.delenv(name)


def script_env(**extra: str) -> dict[str, str]:
    """The environment the scripts run with: clean of launcher variables, short timeouts."""
    env = {k: v for k, v in os.environ.items() if not _set_by_a_launcher(k)}
    # PYTHONFAULTHANDLER: a rank that dies of a signal (a C++ abort in torch's teardown, a
    # segfault) prints every Python thread's stack, so a rare crash in CI says where it was.
    env.update(LITE_COLLECTIVE_TIMEOUT=COLLECTIVE_TIMEOUT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


#: The ids `start_life` hands out, unique in this test process.
_LIVES = itertools.count(1)


def start_life(args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    """`subprocess.Popen(args, env=env, text=True, **kwargs)` for a test script that names its
    process by `LITE_TEST_LIFE` (`life()` in the scripts) where it would write its pid; the id is
    the returned `Popen`'s `life`. Forked from the session's fork server, a program's pid is not
    the `Popen`'s (that is its stand-in's), so a test that matched the two never saw its program."""
    life = next(_LIVES)
    proc = subprocess.Popen(args, env={**env, "LITE_TEST_LIFE": str(life)}, text=True, **kwargs)
    proc.life = life  # type: ignore[attr-defined]
    return proc


@contextlib.contextmanager
def killing_leftovers(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    """Kill whichever of `procs` still runs when the block ends (a failed assertion, a hang guard);
    the list may have a process replaced or added inside the block."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


#: Where `free_port` records the ports it handed out, one empty file per port, for every test
#: process of this machine (pytest-xdist workers, nested pytests, concurrent runs).
_PORT_CLAIMS = Path(tempfile.gettempdir()) / "lite-test-ports"
#: A claim older than this (seconds) is stale: its test has long bound the port or ended.
_CLAIM_LIFETIME = 1800


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now that no other test process of this machine has been given.

    Lite's own `find_free_port` draws it below the kernel's ephemeral range, so that no outgoing
    connection (a gloo pair, a torchft store, an HTTP client) can take it before the test's server
    binds it; a claim file keeps two tests from drawing the same one.
    """
    from lite_core.plugins import find_free_port

    _PORT_CLAIMS.mkdir(exist_ok=True)
    for _ in range(500):
        port = find_free_port()
        if _claim(port):
            return port
    raise RuntimeError(f"no unclaimed free TCP port on 127.0.0.1 (claims in {_PORT_CLAIMS}); remove stale ones")


def _claim(port: int) -> bool:
    claim = _PORT_CLAIMS / str(port)
    try:
        claim.touch(exist_ok=False)
        return True
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - claim.stat().st_mtime > _CLAIM_LIFETIME:
                claim.touch()  # a stale claim, taken over
                return True
        return False


@pytest.fixture(scope="session")
def free_tcp_port() -> Callable[[], int]:
    """`free_tcp_port()` -> a port that is free on 127.0.0.1 right now."""
    return free_port


def _command(script: str | os.PathLike[str], args: tuple[Any, ...], python_args: tuple[str, ...]) -> list[str]:
    path = Path(script)
    if not path.is_absolute():
        path = SCRIPTS / path
    return [sys.executable, *python_args, str(path), *map(str, args)]


@pytest.fixture(scope="session")
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_script("name.py", *args, env=..., input=..., python_args=...)` -> CompletedProcess.

    Runs `python tests/scripts/name.py args...` to completion (at most `SCRIPT_TIMEOUT` seconds),
    capturing its text output. `env` adds variables to `script_env()`; `command` replaces the
    whole command line (e.g. `python -` with the code on stdin).
    """

    def run(script: str | None = None, *args: Any, env: dict[str, str] | None = None,
            input: str | None = None, python_args: tuple[str, ...] = (),
            command: list[str] | None = None, timeout: float = SCRIPT_TIMEOUT) -> subprocess.CompletedProcess[str]:
        cmd = command if command is not None else _command(script, args, python_args)  # type: ignore[arg-type]
        # Like subprocess.run(..., timeout=...), but a script that overruns is killed together
        # with every process it started (its own session), not just the first one.
        # The session is for the kill below only, so the script may still be forked from the
        # session's fork server (LITE_TEST_FORKSERVER_CLEANUP_GROUP: see tools/forkserver).
        proc = subprocess.Popen(cmd, env=script_env(LITE_TEST_FORKSERVER_CLEANUP_GROUP="1", **(env or {})),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=SCRIPTS, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # its first process may be gone already
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    return run


def _signals_as_in_a_terminal() -> None:
    """In a test's child, before it runs: SIGINT back to its default. A pytest started in the
    background by a non-interactive shell (`pytest ... &`, as CI or `nohup` may) ignores SIGINT,
    its children inherit that, and Python then installs no KeyboardInterrupt handler: a test of what
    Ctrl-C does would fail there only."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def signals_as_in_a_terminal() -> Callable[[], None]:
    """The `preexec_fn` that a test's own `Popen` passes (as `start_script` does)."""
    return _signals_as_in_a_terminal


@pytest.fixture
def start_script() -> Any:
    """`start_script("name.py", *args, env=...)` -> Popen, for jobs that must run concurrently.

    Output goes to pipes (read it with `communicate(timeout=...)`); anything still running at the
    end of the test is killed.
    """
    started: list[subprocess.Popen[str]] = []

    def start(script: str, *args: Any, env: dict[str, str] | None = None,
              python_args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        proc = subprocess.Popen(_command(script, args, python_args), env=script_env(**(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=SCRIPTS,
                                start_new_session=True, preexec_fn=_signals_as_in_a_terminal)
        started.append(proc)
        return proc

    yield start
    for proc in started:  # the whole group: a job whose first process died may have left others
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...), or
    None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _live_in_session(session: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == session:
            found.append(int(pid))
    return found


def processes_carrying(variable: str) -> list[int]:
    """The live processes whose environment holds `variable` (`NAME=value`), this user's: a chaos
    job's every process, including those started in a session of their own (a W&B service)."""
    found, wanted = [], variable.encode() + b"\0"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if (b"\0" + environment).find(b"\0" + wanted) >= 0 and process_alive(int(pid)):
            found.append(int(pid))
    return found


def outliving(find: Callable[[], list[int]], patience: float) -> list[int]:
    """What `find()` still returns after `patience` seconds (a hang guard: a job's processes end
    within a second or two of it), or nothing as soon as it returns nothing."""
    deadline = time.monotonic() + patience
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def describe_processes(pids: list[int]) -> list[str]:
    """`pid: command line` of each process, for a failure's message."""
    def command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            return "(ended)"

    return [f"{pid}: {command(pid)}" for pid in pids]


@pytest.fixture(scope="session")
def processes_in_session() -> Callable[[int], list[int]]:
    """`processes_in_session(job.pid)` -> the live processes left of a job `start_script` started
    (each job is its own session, whose id is its first process's pid)."""
    return _live_in_session


@pytest.fixture(scope="session")
def wait_gone() -> Callable[[list[int], float], list[int]]:
    """`wait_gone(pids, seconds)` -> the pids still alive after waiting up to `seconds`."""

    def wait(pids: list[int], seconds: float = 3.0) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            alive = [pid for pid in pids if process_alive(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)

    return wait


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """Exit code and output of a finished script, for assertion messages."""
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@pytest.fixture(scope="session")
def output_of() -> Callable[[subprocess.CompletedProcess[str]], str]:
    """`output_of(proc)` -> a readable dump of a finished script for assertion messages."""
    return describe


@pytest.fixture(scope="session")
def scripts_env() -> Callable[..., dict[str, str]]:
    """`scripts_env(**extra)` -> the environment `run_script` gives its scripts, for custom launches."""
    return script_env


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` in a fresh interpreter (not forked from the test session's server, which has
    imported the backends already), its output captured; 120 s at the most."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, _FORK_SERVER: "0"})


def mse_steps(model: Any, optimizer: Any, batches: Any, backward: Callable[[Any], None]) -> list[float]:
    """One training step per `(x, y)` of `batches` (the MSE of `model(x)` against `y`, `backward(loss)`,
    the optimizer's step); the losses, in order."""
    import torch

    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def wandb_records(run_dir: Path) -> Iterator[Any]:
    """The records of an offline run's `.wandb` file, as wandb's own protobuf `Record`s. The file is
    a 7-byte header (`:W&B`, magic, version) then 32 KiB blocks of chunks, each with a 7-byte header
    (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last) like a LevelDB log."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, pending = 7, b""
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The `history` rows (`log` calls) of an offline run."""
    import json

    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "history"]


def check_each_sample_once(records: list[tuple[int, int, list[int]]], steps: int, batch: int, steps_per_epoch: int,
                           samples: int, skipped: frozenset[int] = frozenset()) -> int:
    """A chaos job's ledger, `(epoch, step, sample ids)` per step a process recorded (a step trained
    again after a rollback appears again): every step 1..`steps` recorded in one epoch with one
    batch of `batch` samples (taken again, it must take the same batch), and every epoch training
    each of its `samples` samples exactly once.

    In the steps of `skipped` (a DiLoCo group healed past them, so its share went untrained) a
    share of the batch may be missing; returns how many samples those steps lack (0 without them).
    """
    from collections import defaultdict

    by_step: dict[int, set[int]] = defaultdict(set)
    epochs: dict[int, int] = {}
    for epoch, step, ids in records:
        by_step[step].update(ids)
        assert epochs.setdefault(step, epoch) == epoch, f"step {step} was recorded in epochs {epochs[step]} and {epoch}"
    missing = sorted(set(range(1, steps + 1)) - set(by_step))
    assert sorted(by_step) == list(range(1, steps + 1)), f"steps missing from the ledger: {missing}, in it: {sorted(by_step)}"
    for step, ids in by_step.items():
        assert len(ids) == batch or (step in skipped and len(ids) < batch), (
            f"step {step} trained on {sorted(ids)}: a step took two different batches")
    lacking = sum(batch - len(ids) for ids in by_step.values())
    for epoch in range(steps // steps_per_epoch):
        seen = [i for step, ids in by_step.items() if epochs[step] == epoch for i in ids]
        repeated = len(seen) - len(set(seen))
        lacks = sum(batch - len(ids) for step, ids in by_step.items() if epochs[step] == epoch)
        assert repeated == 0 and len(seen) == samples - lacks and set(seen) <= set(range(samples)), (
            f"epoch {epoch} trained {len(set(seen))} distinct samples of {samples}, {repeated} more than once")
    return lacking



# -- the trackers a chaos job logs to (packages/lite-torchft/tests/_chaos.py, tests/integration/elastic/test_chaos_nodes.py)
class MLflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store in `folder`; `stop()` kills it (its whole
    process group), `start()` brings it back on the same port and store. `patience`: seconds any
    wait may take, a hang guard (it answers in seconds, and is gone in milliseconds)."""

    def __init__(self, folder: Path, port: int, patience: float = 240.0) -> None:
        self.folder, self.port, self.patience = folder, port, patience
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import urllib.request

        command = [sys.executable, "-m", "mlflow", "server",
                   "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
                   "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", "1"]
        log = (self.folder / "server.log").open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=log, cwd=self.folder, start_new_session=True)
        deadline = time.monotonic() + 2 * self.patience
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"mlflow server did not answer: {(self.folder / 'server.log').read_text()[-4000:]}")

    def stop(self) -> None:
        """Kill the server's process group and wait until none of it is left to answer on the port."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + self.patience
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def check_tracked_steps(tracker: str, logged: list[tuple[int, float]], trained: dict[int, set[float]],
                        steps: int) -> None:
    """`logged` (step, value) holds every step 1..`steps` once, each with a value that the job's
    ledger says the step trained with (`trained`: per step, every value its attempts logged)."""
    held = [step for step, _ in logged]
    assert sorted(held) == list(range(1, steps + 1)), (
        f"{tracker} holds steps {held}: missing {sorted(set(range(1, steps + 1)) - set(held))},"
        f" twice {sorted({s for s in held if held.count(s) > 1})}")
    wrong = {step: (value, sorted(trained.get(step, ()))) for step, value in logged if value not in trained.get(step, ())}
    assert not wrong, f"{tracker}: steps logged with a value no attempt trained (logged, trained): {wrong}"


def check_trackio_run(store: Path, project: str, key: str, trained: dict[int, set[float]], steps: int,
                      patience: float = 240.0) -> None:
    """One trackio run in the local store `store` (a TRACKIO_DIR) holding `key` at every step once,
    each with a value the ledger says (read in a fresh process: trackio reads TRACKIO_DIR on import)."""
    import json

    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S;"
            f" runs = S.get_runs({project!r});"
            f" print(json.dumps([runs, [S.get_logs({project!r}, run) for run in runs]], default=str))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRACKIO_DIR=str(store)),
                          capture_output=True, text=True, timeout=patience, check=True)
    runs, logs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs) == 1, f"the job logged to {len(runs)} trackio runs: {runs}"
    check_tracked_steps("trackio", [(int(row["step"]), row[key]) for row in logs[0] if key in row], trained, steps)


def check_mlflow_run(uri: str, experiment: str, key: str, trained: dict[int, set[float]], steps: int,
                     fallback_dirs: list[Path]) -> None:
    """One MLflow run in `experiment` on the server at `uri` holding `key` at every step once (its
    metric history keeps every value sent, so a step sent twice shows), each with a value the
    ledger says; and nothing left unsent (no `mlflow-unsent-*` file in `fallback_dirs`)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment} on the server"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"the job logged to {len(runs)} MLflow runs: {[run.info.run_id for run in runs]}"
    history = client.get_metric_history(runs[0].info.run_id, key)
    check_tracked_steps("MLflow", [(metric.step, metric.value) for metric in history], trained, steps)
    unsent = [path for folder in fallback_dirs for path in folder.glob("mlflow-unsent-*")]
    assert not unsent, f"MLflowLogger wrote values it could not send to {unsent}"


def check_wandb_run(folders: list[Path], key: str, trained: dict[int, set[float]], steps: int) -> int:
    """One W&B run id over a job's offline run folders (`offline-run-*`: a new one after each
    checkpoint, see docs/logging.md), holding `key` at every step as `wandb sync` keeps it (the
    first row of a step, folder after folder in their names' order, which is their start time's),
    each with a value the ledger says. A step the files hold with two values must be one the ledger
    shows trained twice with those values: rows of steps that a job wrote after its last committed
    checkpoint stay in its folder when the resumed job writes them again (W&B's files are
    append-only; `wandb sync` keeps the first), and a step trained again after a rollback by another
    set of processes may log another value. Returns how many steps the files hold with two values."""
    from collections import defaultdict

    folders = sorted(folders, key=lambda folder: folder.name)
    ids = {next(folder.glob("run-*.wandb")).stem.removeprefix("run-") for folder in folders}
    assert len(ids) == 1, f"the job logged to {len(ids)} W&B runs: {sorted(ids)}"
    values: dict[int, list[float]] = defaultdict(list)
    for folder in folders:
        for row in wandb_history(folder):
            if key in row:
                values[int(row["_step"])].append(float(row[key]))
    two = {step: sorted(set(held)) for step, held in values.items() if len(set(held)) > 1}
    once = {step: (held, sorted(trained.get(step, ()))) for step, held in two.items()
            if len(trained.get(step, ())) < 2 or not set(held) <= trained[step]}
    assert not once, f"W&B holds steps with two different values that the ledger does not show trained twice: {once}"
    check_tracked_steps("W&B", [(step, held[0]) for step, held in values.items()], trained, steps)
    return len(two)


def linear_adam(lr: float, **lite_kwargs: Any) -> tuple[Any, Any, Any]:
    """A one-process `LightningLite(accelerator="cpu", **lite_kwargs)` and a set-up `nn.Linear(3, 2)`
    with its Adam optimizer (learning rate `lr`), as the checkpoint tests train them."""
    import torch

    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", **lite_kwargs)
    model = torch.nn.Linear(3, 2)
    model, optimizer = lite.setup(model, torch.optim.Adam(model.parameters(), lr=lr))
    return lite, model, optimizer


def squared_step(lite: Any, model: Any, optimizer: Any) -> None:
    """One step of `linear_adam`'s model on a batch of ones, the squared outputs' sum as the loss."""
    import torch

    optimizer.zero_grad()
    lite.backward(model(torch.ones(4, 3)).pow(2).sum())
    optimizer.step()


def _assert_weights_match(actual: dict[str, Any], expected: dict[str, Any], initial: dict[str, Any]) -> None:
    import torch

    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-6, rtol=0, msg=name)
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-2, "training barely changed the weights; the comparison would prove nothing"


@pytest.fixture(scope="session")
def assert_weights_match() -> Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], None]:
    """`assert_weights_match(actual, expected, initial)`: state dicts equal within 1e-6, and training
    really moved the weights (otherwise the comparison would prove nothing)."""
    return _assert_weights_match


def _tensor(values: Any, dtype: str) -> dict[str, Any]:
    return {"tensor": values, "dtype": dtype, "device": "cpu"}


def _container(kind: str, *items: Any) -> dict[str, Any]:
    return {"type": kind, "items": list(items)}


#: What every rank of a 2-process CPU job sees from `tests/scripts/_user_collectives.record`.
_USER_COLLECTIVES = {
    "device": "cpu",
    "mnist_test_loss": _tensor(8.0, "torch.float32"),
    "float_sum": _tensor(3.0, "torch.float32"),
    "int_mean": _tensor(1.0, "torch.float32"),
    "bool_sum": _tensor(1, "torch.int64"),
    "float_gather": _tensor([0.5, 1.5], "torch.float32"),
    "nested_reduce": {"loss": _tensor(1.5, "torch.float32"),
                      "parts": _container("list", _tensor([1, 2], "torch.int64"), _tensor(4, "torch.int64")),
                      "pair": _container("tuple", _tensor(1, "torch.int64"), _tensor(3.0, "torch.float32"))},
    "nested_gather": {"x": _tensor([[0], [1]], "torch.int64"),
                      "n": _container("list", _tensor([0, 10], "torch.int64"), _tensor([0.5, 0.5], "torch.float32"))},
    "broadcast_number": {"python": 11, "type": "int"},
    "broadcast_tensor": {"t": _tensor([1.0], "torch.float32"), "k": {"python": "v", "type": "str"}},
    "mismatch_error": ("all_gather needs the same tensor shape on every rank but rank 0 has (1, 2), rank 1 has"
                       " (2, 2): pad or trim the tensors to one shape on every rank (e.g. with"
                       " torch.nn.functional.pad) before gathering."),
    "after_mismatch": _tensor(2.0, "torch.float32"),
}


def _check_user_collectives(records: dict[int, dict[str, Any]]) -> None:
    assert set(records) == {0, 1}
    for rank, record in records.items():
        for key, expected in _USER_COLLECTIVES.items():
            assert record[key] == expected, f"rank {rank}, {key}"


@pytest.fixture(scope="session")
def check_user_collectives() -> Callable[[dict[int, dict[str, Any]]], None]:
    """`check_user_collectives({rank: record})`: each rank of a 2-process CPU job got, from the
    collectives a user's loop calls (`tests/scripts/_user_collectives.py`), tensors on its device
    with the right values, Python numbers only from `broadcast`, and the same one-sentence error
    for an `all_gather` of different shapes."""
    return _check_user_collectives


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `TORCHINDUCTOR_CACHE_DIR` for the whole pytest run, for this process and every script it
    starts: a graph that `torch.compile` built once (in any rank, any test) is read back, not built again."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))
    yield os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if saved is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def set_up_model_job(run_script, tmp_path_factory, inductor_cache) -> Callable[..., Any]:
    """`set_up_model_job(strategy, devices, timeout=240)` -> (record, out_dir) of
    `tests/scripts/set_up_model.py` (methods, torch.compile and a tiny GPT-2 through Lite), run
    once per strategy in a pytest run."""
    import json

    jobs: dict[tuple[str, int], Any] = {}

    def get(strategy: str, devices: int, timeout: float = 240) -> Any:
        if (strategy, devices) not in jobs:
            out_dir = tmp_path_factory.mktemp(f"set-up-model-{strategy}")
            proc = run_script("set_up_model.py", strategy, devices, out_dir, timeout=timeout)
            assert proc.returncode == 0, describe(proc)
            jobs[strategy, devices] = (json.loads((out_dir / "record.json").read_text()), out_dir)
        return jobs[strategy, devices]

    return get


# -- a real S3 API on loopback ------------------------------------------------------------------
class S3Server:
    """moto's S3 server on 127.0.0.1, in this process (its buckets live here, so `stop()` and
    `start()` again on the same port keep them). `env` holds what a client needs (credentials,
    the endpoint, one attempt per request so that a stopped server fails a call at once); the
    scripts get it through `script_env(**server.env)`."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server_class = ThreadedMotoServer
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                    "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
        self._server: Any = None
        self._buckets = 0

    def start(self) -> None:
        if self._server is None:
            self._server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def new_bucket(self) -> str:
        """A fresh, empty bucket's name."""
        import fsspec

        self._buckets += 1
        name = f"bucket-{self._buckets}"
        fsspec.filesystem("s3", endpoint_url=self.endpoint, key="testing", secret="testing",
                          skip_instance_cache=True).mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Any:
    """The session's `S3Server` (skipped where moto is not installed: `hatch.toml`'s `test`
    environment installs it with s3fs)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://BUCKET` of a fresh bucket on the running `s3_server`; this process's S3 clients are
    pointed at it by the environment, as a user's would be."""
    import moto.settings
    import s3fs

    s3_server.start()
    s3fs.S3FileSystem.clear_instance_cache()  # no connection of a server stopped by an earlier test
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))  # any credentials pass
    return f"s3://{s3_server.new_bucket()}"
